"""Day 48: where the time of one decode step goes (SmolLM2-135M, fp32, CPU).

An `Engine` runs `batch` requests off prompts of `prompt_len` random tokens, steps past the
prefill and a few warm-up decode steps, then runs `steps` decode steps under `torch.profiler`.
Every aten op the profiler records is put in one stage of the step: the package's functions
are wrapped, for the duration of the profile only, in `record_function` labels
(`stage_labels`), and an op belongs to the nearest label above it. The weights a stage reads
are known by identity (`matrix_stages`), so each matrix stage also gets its bytes and FLOPs.

Deterministic per stage: the aten ops it dispatches per step (from Python, and nested ones
included), the MFLOPs and the MB it reads. Measured: its time (the profiler's self time of its
ops plus its labels' own time, the interpreter between ops), its share of the step's wall time,
and the achieved read bandwidth. What no label covers (the engine's own glue, the profiler's
own cost) is the row `engine_other`: wall time minus everything else. The CSV has one row per
stage and a column per measure and batch (`ms_b8`: milliseconds at batch 8).

    python days/day48/profile_step.py                 # batch 1 and 8 -> day-48-profile.csv
    python days/day48/profile_step.py --batch 1 --batch 32 --steps 8 --out /tmp/p.csv
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import record_function

import nanoserve.cache
import nanoserve.engine
import nanoserve.models.llama
from nanocourse import cpu_profile, engine_config, write_csv
from nanoserve.engine import Engine
from nanoserve.errors import GateError
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-48-profile.csv"
BATCHES = (1, 8)
PROMPT_LEN = 16  # decode steps at positions 16 to 31: two blocks of 16, so W = 32 on each
WARM_STEPS = 2
STEPS = 6  # timed, then profiled, decode steps per batch (the fastest of each is kept)
MAX_MODEL_LEN = 256
LABEL = "stage:"
# the sampler as the engine module names it (`sample_rows` keeps one row's failure to that row)
SAMPLER = "sample_rows" if hasattr(nanoserve.engine, "sample_rows") else "sample"
# The step in the order it runs. The five matrix stages are one weight matrix each.
STAGES = (
    "schedule",
    "plan",
    "embed",
    "norm",
    "qkv_proj",
    "rope",
    "kv_write",
    "attention",
    "o_proj",
    "mlp_gate_up",
    "mlp_act",
    "mlp_down",
    "block_glue",
    "head",
    "sampling",
    "append",
    "engine_other",
)
MATRIX_STAGES = ("qkv_proj", "o_proj", "mlp_gate_up", "mlp_down", "head")
BANDWIDTH_STAGES = (*MATRIX_STAGES, "attention")  # the stages that read megabytes
# ops that only make views: they move no data and are left out of a stage's op names
VIEW_OPS = {
    "aten::view",
    "aten::reshape",
    "aten::transpose",
    "aten::unsqueeze",
    "aten::expand",
    "aten::slice",
    "aten::select",
    "aten::as_strided",
    "aten::_unsafe_view",
    "aten::t",
    "aten::detach",
    "aten::detach_",
    "aten::alias",
    "aten::lift_fresh",
    "aten::split",
    "aten::chunk",
    "aten::narrow",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::resize_",
    "aten::to",
    "aten::_to_copy",
    "aten::result_type",
}


def matrix_stages(model) -> dict[int, str]:
    """id(weight) -> the matrix stage that reads it. The head is the embedding (tied)."""
    names = {id(model.head): "head"}
    for b in model.blocks:
        names |= {
            id(b.qkv): "qkv_proj",
            id(b.o): "o_proj",
            id(b.gate_up): "mlp_gate_up",
            id(b.down): "mlp_down",
        }
    return names


def weight_bytes(model) -> int:
    """Bytes of every distinct parameter: what one step reads (the tied head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextmanager
def _patched(obj, attr, make):
    orig = getattr(obj, attr)
    setattr(obj, attr, make(orig))
    try:
        yield
    finally:
        setattr(obj, attr, orig)


def _labelled(name):
    def make(fn):
        def wrapper(*args, **kwargs):
            with record_function(LABEL + name):
                return fn(*args, **kwargs)

        return wrapper

    return make


@contextmanager
def stage_labels(engine: Engine, names: dict[int, str] | None = None):
    """Wrap the package's functions in `record_function` labels while the block runs.

    `names` maps id(weight) -> stage for `linear` (default: `matrix_stages(engine.model)`); a
    weight it lacks is labelled `unlabelled_matrix`. Block and Llama forwards get labels too,
    so their inline ops (residual adds, silu * up, the embedding gather) have a home."""
    names = matrix_stages(engine.model) if names is None else names

    def linear(orig):
        def wrapper(x, w):
            with record_function(LABEL + names.get(id(w), "unlabelled_matrix")):
                return orig(x, w)

        return wrapper

    with (
        _patched(nanoserve.models.llama, "linear", linear),
        _patched(nanoserve.models.llama, "rms_norm", _labelled("norm")),
        _patched(nanoserve.models.llama, "apply_rope", _labelled("rope")),
        _patched(nanoserve.models.llama.Block, "forward", _labelled("block")),
        _patched(nanoserve.models.llama.Llama, "forward", _labelled("model")),
        _patched(nanoserve.cache.BatchedCacheRows, "write", _labelled("kv_write")),
        _patched(nanoserve.cache.BatchedCacheRows, "attention", _labelled("attention")),
        _patched(nanoserve.engine, SAMPLER, _labelled("sampling")),
        _patched(engine.scheduler, "schedule", _labelled("schedule")),
        _patched(engine.runner, "plan", _labelled("plan")),
        _patched(engine, "_append", _labelled("append")),
    ):
        yield


def _stage_of(event) -> str | None:
    """The stage an aten op belongs to: its nearest label; inside a block but under no finer
    label, silu and mul are the MLP's activation and the rest is block glue."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(LABEL):
        parent = parent.cpu_parent
    if parent is None:
        return "engine_other"
    label = parent.name.removeprefix(LABEL)
    if label == "block":
        return "mlp_act" if event.name in ("aten::silu", "aten::mul") else "block_glue"
    return {"model": "embed"}.get(label, label)


@dataclass
class StepProfile:
    """What `profile_steps` saw in the step it kept (totals over `steps` steps: 1 as it runs)."""

    batch: int
    steps: int
    width: int  # the slot window's width W on every profiled step
    wall_s: float  # the kept step, perf_counter, profiler on
    plain_wall_s: float  # the fastest step right before, profiler off (inf: none were timed)
    calls: dict = field(default_factory=lambda: defaultdict(int))  # stage -> aten ops, nested included
    py_calls: dict = field(default_factory=lambda: defaultdict(int))  # stage -> aten ops called from Python
    top_calls: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))  # stage -> op -> n
    op_us: dict = field(default_factory=lambda: defaultdict(float))  # stage -> self time of its ops
    py_us: dict = field(default_factory=lambda: defaultdict(float))  # stage -> its labels' own time
    op_self_us: dict = field(default_factory=lambda: defaultdict(float))  # op name -> self time
    op_count: dict = field(default_factory=lambda: defaultdict(int))  # op name -> calls
    plans_decode: list = field(default_factory=list)  # per profiled step: was it a decode step


def build_engine(model, batch: int, prompt_len: int = PROMPT_LEN, seed: int = 0) -> Engine:
    """An engine with `batch` requests of `prompt_len` random ordinary tokens, not yet stepped."""
    cfg = model.cfg
    block = 16
    blocks = batch * (MAX_MODEL_LEN // block) + 1
    config = engine_config(
        48,  # the engine as of day 48: prefill-first, gather attention, plain linears, ops step
        max_batch=batch,
        max_model_len=MAX_MODEL_LEN,
        block_size=block,
        kv_budget=cfg.kv_bytes_per_token(model.dtype) * block * blocks,
    )
    engine = Engine(model, None, config)
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        prompt = torch.randint(100, cfg.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=MAX_MODEL_LEN - prompt_len, ignore_eos=True))
    return engine


def warm_profiler() -> None:
    """The first profile of a process pays the profiler's start-up inside it; pay it here."""
    with cpu_profile():
        torch.ones(4).sum()


def profile_steps(
    engine: Engine, steps: int, names: dict[int, str] | None = None, timed_first: bool = True
) -> StepProfile:
    """Run `steps` engine steps, each under its own profile, and put every aten op of the least
    disturbed one (the fastest) into its stage: on a shared machine the fastest step is the one
    the other jobs interfered with least, and the counts are the same in every step. With
    `timed_first`, as many steps run just before with the profiler off, timed."""
    plans = []
    orig_execute = engine.runner.execute

    def execute(plan):
        plans.append(plan)
        return orig_execute(plan)

    plain = float("inf")
    for _ in range(steps if timed_first else 0):
        t0 = time.perf_counter()
        engine.step()
        plain = min(plain, time.perf_counter() - t0)
    warm_profiler()
    best = None
    with _patched(engine.runner, "execute", lambda orig: execute), stage_labels(engine, names):
        for _ in range(steps):
            with cpu_profile() as prof:
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
            if best is None or wall < best[0]:
                best = (wall, prof, plans[-1])
    widths = {p.slot_window.shape[1] for p in plans if p.is_decode}
    if len(widths) > 1:  # the kept step's bytes would depend on which step was fastest
        raise ValueError(f"the profiled decode steps span widths {sorted(widths)}; profile fewer steps")
    wall, prof, plan = best
    out = StepProfile(len(plan.rows), 1, plan.slot_window.shape[1], wall, plain)
    out.plans_decode = [p.is_decode for p in plans]
    for e in prof.events():
        if e.name.startswith(LABEL):
            label = e.name.removeprefix(LABEL)
            stage = {"model": "embed", "block": "block_glue"}.get(label, label)
            out.py_us[stage] += e.self_cpu_time_total
        elif e.name.startswith("aten::"):
            stage = _stage_of(e)
            out.calls[stage] += 1
            out.op_us[stage] += e.self_cpu_time_total
            out.op_self_us[e.name] += e.self_cpu_time_total
            out.op_count[e.name] += 1
            if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"):
                out.py_calls[stage] += 1
                if e.name not in VIEW_OPS:
                    out.top_calls[stage][e.name] += 1
    return out


def profile_decode(
    model, batch: int, steps: int = STEPS, names=None, prompt_len: int = PROMPT_LEN
) -> StepProfile:
    """Prefill `batch` requests, take WARM_STEPS decode steps, time `steps` more, then profile
    `steps` more and keep the fastest."""
    engine = build_engine(model, batch, prompt_len)
    engine.step()  # the prefill: every prompt fits in one step's token budget
    for _ in range(WARM_STEPS):
        engine.step()
    return profile_steps(engine, steps, names)


# --- what a stage reads and computes (arithmetic on the config alone) -------------------------


def stage_work(cfg, batch: int, width: int, bytes_per: int = 4) -> dict[str, tuple[int, int]]:
    """stage -> (FLOPs, bytes read) for one decode step of `batch` rows over a window of `width`.

    Matrices: 2 * rows * in * out FLOPs and every weight byte. Attention gathers `width` slots
    of K and V per row and layer (masked positions included: the gather reads them) and does
    2 * 2 * heads * width * head_dim FLOPs per row. Norm weights, the embedding rows gathered
    and the new K/V written are counted as what they read or write."""
    L, h, i, hd = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    mat = {
        "qkv_proj": (L, h, q + 2 * kv),
        "o_proj": (L, q, h),
        "mlp_gate_up": (L, h, 2 * i),
        "mlp_down": (L, i, h),
        "head": (1, h, cfg.vocab_size),
    }
    work = {s: (2 * batch * n * a * b, n * a * b * bytes_per) for s, (n, a, b) in mat.items()}
    work["attention"] = (L * batch * 4 * cfg.num_heads * width * hd, L * batch * width * 2 * kv * bytes_per)
    work["kv_write"] = (0, L * batch * 2 * kv * bytes_per)
    work["norm"] = ((2 * L + 1) * batch * 4 * h, (2 * L + 1) * h * bytes_per)
    work["embed"] = (0, batch * h * bytes_per)
    return work


def rows(p: StepProfile, cfg) -> list[dict]:
    """One row per stage, per step (totals divided by the profiled steps)."""
    work = stage_work(cfg, p.batch, p.width)
    wall_ms = p.wall_s * 1e3 / p.steps
    known = {s: (p.op_us[s] + p.py_us[s]) / 1e3 / p.steps for s in STAGES if s != "engine_other"}
    out = []
    for s in STAGES:
        flops, nbytes = work.get(s, (0, 0))
        ops = sorted(p.top_calls[s].items(), key=lambda kv: (-kv[1], kv[0]))
        op_ms = p.op_us[s] / 1e3 / p.steps
        ms = known[s] if s != "engine_other" else wall_ms - sum(known.values())
        out.append(
            {
                "batch": p.batch,
                "stage": s,
                "ops": " ".join(name.removeprefix("aten::") for name, _ in ops[:3]) or "-",
                "py_calls": p.py_calls[s] // p.steps,
                "aten_calls": p.calls[s] // p.steps,
                "mflop": round(flops / 1e6, 1),
                "mb_read": round(nbytes / 1e6, 2),
                "op_ms": round(op_ms, 2),
                "ms": round(ms, 2),
                "share": round(100 * ms / wall_ms, 1),
                "gb_s": round(nbytes / (ms * 1e6), 1) if s in BANDWIDTH_STAGES and ms > 0 else "",
            }
        )
    return out


def table(profiles: dict[int, StepProfile], cfg) -> list[dict]:
    """The CSV: one row per stage, a column per (measure, batch), e.g. `ms_b8`. Calls from Python
    are the same at every batch (one column); nested calls are not (a column per batch)."""
    per_batch = {b: {r["stage"]: r for r in rows(p, cfg)} for b, p in profiles.items()}
    first = next(iter(per_batch.values()))
    out = []
    for s in STAGES:
        py = {per_batch[b][s]["py_calls"] for b in per_batch}
        if len(py) != 1:
            raise ValueError(f"stage {s} calls {sorted(py)} ops from Python at batches {list(per_batch)}")
        row = {"stage": s, "ops": first[s]["ops"], "py_calls": py.pop()}
        for col in ("aten_calls", "mflop", "mb_read", "ms", "share", "gb_s"):
            row |= {f"{col}_b{b}": per_batch[b][s][col] for b in per_batch}
        out.append(row)
    return out


def summary(p: StepProfile) -> dict:
    """Per step: wall time with and without the profiler, op time, and the rest (Python)."""
    op_ms = sum(p.op_us.values()) / 1e3 / p.steps
    wall = p.wall_s * 1e3 / p.steps
    return {
        "batch": p.batch,
        "py_calls": sum(p.py_calls.values()) // p.steps,
        "aten_calls": sum(p.calls.values()) // p.steps,
        "wall_ms": wall,
        "plain_wall_ms": p.plain_wall_s * 1e3 / p.steps,
        "op_ms": op_ms,
        "python_ms": wall - op_ms,
    }


# --- gates -----------------------------------------------------------------------------------


def check_decode_only(p: StepProfile) -> None:
    """Every profiled step was a decode step: a prefill step in the window mixes another
    workload (many tokens per row, a per-row attention loop) into a decode profile."""
    prefill = [i for i, d in enumerate(p.plans_decode) if not d]
    if prefill:
        raise GateError(
            f"profiled steps {prefill} of {len(p.plans_decode)} were prefill steps, not decode; "
            "step past the prefill before profiling"
        )


def check_weights_accounted(model, names: dict[int, str]) -> None:
    """The matrix stages' weights plus the norms are every byte of the model's weights: a step
    reads all of them, and a stage map that misses one hides where its time went."""
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    params = {id(p): p for p in model.parameters()}
    mapped = sum(params[i].numel() * params[i].element_size() for i in names if i in params)
    total = weight_bytes(model)
    if mapped + norms != total:
        raise GateError(
            f"the stage map names {mapped + norms:,} bytes of weights (norms included) but the model "
            f"has {total:,}: {total - mapped - norms:,} bytes are read by an unlabelled matrix"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, action="append", help="rows (repeat; default 1 and 8)")
    p.add_argument("--steps", type=int, default=STEPS, help="profiled decode steps per batch")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    from nanoserve.models import load_model
    from nanoserve.weights import resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(resolve_model_dir(args.model))
    names = matrix_stages(model)
    check_weights_accounted(model, names)
    profiles = {}
    for b in args.batch or BATCHES:
        prof = profile_decode(model, b, args.steps, names)
        check_decode_only(prof)
        profiles[b] = prof
        s = summary(prof)
        print(
            f"batch {b}: {s['py_calls']} aten calls from Python a step ({s['aten_calls']} nested), "
            f"wall {s['wall_ms']:.1f} ms "
            f"(profiler off {s['plain_wall_ms']:.1f} ms), ops {s['op_ms']:.1f} ms, "
            f"the rest {s['python_ms']:.1f} ms"
        )
    out = table(profiles, model.cfg)
    for r in out:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(out, args.out, cpu=True)}")


if __name__ == "__main__":
    main()
