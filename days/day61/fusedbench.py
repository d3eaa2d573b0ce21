"""Day 61's benchmark: a decode step as torch ops against the same step as one native call.

SmolLM2-135M-Instruct decodes `rows` requests at once through two engines that differ only in
`EngineConfig.decode_step`: "ops" (the model's torch ops, plain fp32 or Q4_1 linears) and
"fused" (`Llama.fused_decode`, csrc/quant.cpp). Weights are the GGUF's own Q4_1 blocks
(`load_gguf_model`) or fp32 (`load_model`, linears plain: the fused step cannot read oneDNN's
packed layout). For each (weights, rows, step):

* the aten ops one engine decode step dispatches (a TorchDispatchMode counts them, the ones
  C++ dispatches from inside the native call included), and those of the forward alone;
* the step's wall time, the best of `reps` steps, the two engines alternating step by step;
* the weights' bytes and what reading them once costs at the measured read bandwidth.

`day-61-peer.csv` (with `--llama-server BIN`, optionally `--llama-bench BIN`) is day 60's
batch-1 comparison with llama.cpp again, now with the fused step: greedy decode of
`nanoserve.bench.DECODE_PROMPT`, 64 tokens past the prompt, the GGUF's Q4_1 blocks with fp32 and
with int8 activations, each on both steps; the four engines take three turns, each keeps its
best rate (`decode_rate`, prefill taken out), then llama-server and llama-bench on the same file.

`day-61-compile.csv` is the other way to remove per-op cost: `torch.compile` (inductor, default
mode) on the ops path's forward at batch 1, fp32: `torch._dynamo.explain`'s graphs and breaks,
the first call's seconds, and the step after.

    python days/day61/fusedbench.py                    # rows 1, 4, 16; both weights; compile
    python days/day61/fusedbench.py --rows 1 --reps 5 --no-compile --out /tmp/f.csv
    LD_LIBRARY_PATH=BIN_DIR python days/day61/fusedbench.py --peer-only \
        --llama-server BIN_DIR/llama-server --llama-bench BIN_DIR/llama-bench
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanocourse import engine_config, top2_gap, write_csv
from nanoserve.bench import (
    DECODE_PROMPT,
    agreement,
    cpu_line,
    decode_turns,
    first_difference,
    llama_bench_decode,
    llama_server_decode,
    read_bandwidth_gbs,
)
from nanoserve.engine import Engine
from nanoserve.models import LlamaConfig, load_gguf_model, load_model, model_weight_bytes
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_gguf, fetch_default_model

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-61-fused.csv"
COMPILE_CSV = HERE / "day-61-compile.csv"
PEER_CSV = HERE / "day-61-peer.csv"
QUESTIONS = (
    "What is 2 + 2?",
    "Name a colour.",
    "Say hi.",
    "Why is the sky blue?",
)


class OpCount(TorchDispatchMode):
    """Counts every aten op dispatched while it is on, by name."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def load(weights: str):
    """The default model with `weights` "q4_1" (the GGUF's own blocks) or "fp32", and its tokenizer."""
    model_dir = fetch_default_model()
    if weights == "q4_1":
        model = load_gguf_model(fetch_default_gguf(), LlamaConfig.from_dir(model_dir), "q4_1")
    else:
        model = load_model(model_dir)
    return model, Tokenizer.from_dir(model_dir)


def decoding_engine(model, tok, step: str, rows: int, max_tokens: int = 200) -> Engine:
    """An engine whose `rows` requests are past their prompts: its next step() is a decode step."""
    config = engine_config(
        61, max_batch=rows, decode_step=step, linear="plain", max_model_len=256, kv_budget=rows * 2**24
    )
    eng = Engine(model, tok, config)
    for i in range(rows):
        question = QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))
        eng.add_request(
            [{"role": "user", "content": question}], SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
    while eng.step_kinds["decode"] == 0:
        eng.step()
    assert eng.decode_step == step and len(eng.scheduler.running) == rows
    return eng


def count_step(eng: Engine) -> tuple[int, int]:
    """(aten ops of one engine decode step, of its forward alone)."""
    forward, inner = eng.runner._forward, OpCount()

    def counted(plan):
        with inner:
            return forward(plan)

    eng.runner._forward = counted
    with OpCount() as whole:
        eng.step()
    del eng.runner._forward
    return whole.total, inner.total


def best_steps(engines: dict[str, Engine], reps: int) -> dict[str, float]:
    """Seconds of one decode step, the best of `reps`, the engines taking turns."""
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(reps):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            eng.step()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def measure(model, tok, weights: str, rows: int, reps: int, bandwidth: float) -> list[dict]:
    engines = {step: decoding_engine(model, tok, step, rows) for step in ("ops", "fused")}
    counts = {step: count_step(eng) for step, eng in engines.items()}
    seconds = best_steps(engines, reps)
    weight_mb = model_weight_bytes(model) / 1e6
    weights_ms = weight_mb * 1e6 / (bandwidth * 1e9) * 1e3
    out = []
    for step in ("ops", "fused"):
        ms = seconds[step] * 1e3
        out.append(
            {
                "weights": weights,
                "rows": rows,
                "step": step,
                "ops_step": counts[step][0],
                "ops_forward": counts[step][1],
                "weight_mb": round(weight_mb, 1),
                "step_ms": round(ms, 2),
                "token_ms": round(ms / rows, 2),
                "weights_ms": round(weights_ms, 2),
                "rest_ms": round(max(ms - weights_ms, 0.0), 2),
            }
        )
    ops, fused = out
    removed = ops["ops_step"] - fused["ops_step"]
    us = (ops["step_ms"] - fused["step_ms"]) * 1e3 / removed
    for row in out:
        row["us_per_removed_op"] = round(us, 1)
        row["speedup"] = round(ops["step_ms"] / fused["step_ms"], 2)
    return out


def compile_row(model, tok, reps: int) -> dict:
    """torch.compile (inductor, default mode) on the ops path's forward of a batch-1 decode step."""
    eng = decoding_engine(model, tok, "ops", 1)
    runner = eng.runner
    plan = runner.plan(eng.scheduler.schedule())

    def forward(ids, positions):
        return model(ids, positions, runner.cache.view(plan), logits_at=plan.logits_at)

    row = {"target": "Llama.forward, decode, batch 1, fp32 plain", "backend": "inductor"}
    try:
        explained = torch._dynamo.explain(forward)(plan.input_ids, plan.positions)
        row["graphs"] = explained.graph_count
        row["graph_breaks"] = explained.graph_break_count
        reasons = sorted({r.reason.splitlines()[0][:80] for r in explained.break_reasons})
        row["first_break"] = reasons[0] if reasons else ""
        torch._dynamo.reset()
        compiled = torch.compile(forward)
        with torch.inference_mode():
            t0 = time.perf_counter()
            want = forward(plan.input_ids, plan.positions)
            got = compiled(plan.input_ids, plan.positions)
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            row["max_diff"] = f"{(got - want).abs().max().item():.1e}"
            best = {"eager": float("inf"), "compiled": float("inf")}
            for _ in range(reps):
                for name, fn in (("eager", forward), ("compiled", compiled)):
                    t0 = time.perf_counter()
                    fn(plan.input_ids, plan.positions)
                    best[name] = min(best[name], time.perf_counter() - t0)
        row["eager_ms"] = round(best["eager"] * 1e3, 2)
        row["compiled_ms"] = round(best["compiled"] * 1e3, 2)
        row["status"] = "ok"
    except Exception as e:  # record what happened instead of stopping the benchmark
        row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def peer_table(llama_server: str, llama_bench: str | None, n_tokens: int = 64, reps: int = 3) -> list[dict]:
    """Batch-1 decode rates of the Q4_1 engines (fp32 and int8 activations, ops and fused steps)
    and of llama.cpp on the same file and prompt; with fp32 activations both steps give the same
    tokens."""
    model_dir, gguf = fetch_default_model(), fetch_default_gguf()
    cfg, tok = LlamaConfig.from_dir(model_dir), Tokenizer.from_dir(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": DECODE_PROMPT}])
    engines, models = {}, {}
    for acts in ("fp32", "int8"):
        model = models[acts] = load_gguf_model(gguf, cfg, "q4_1", acts)
        for step in ("ops", "fused"):
            config = engine_config(61, max_batch=1, decode_step=step, linear="plain")
            engines[(f"q4_1/{acts}", step)] = Engine(model, tok, config)
    best, tokens = decode_turns(engines, prompt, n_tokens, reps)
    # the two steps sum the same products in other orders: fp32 activations must give the same
    # tokens; int8 activations may part at a near tie (a rounding moves an activation one int8
    # step), and the table says where, and how far apart the top two logits were there
    parted, gaps = {}, {}  # variant -> "equal" / "differ at N"; -> the top-2 gap at N
    for acts in ("fp32", "int8"):
        variant = f"q4_1/{acts}"
        ops, fused = tokens[(variant, "ops")], tokens[(variant, "fused")]
        p = first_difference(ops, fused)
        assert p is None or acts == "int8", f"fp32 activations: the fused step parts from the ops step at {p}"
        parted[variant] = agreement(fused, ops)
        if p is not None:
            gaps[variant] = round(top2_gap(models[acts], prompt + ops[:p]), 3)
    rate, peer = llama_server_decode(llama_server, gguf, prompt, n_tokens, torch.get_num_threads())
    best[("llama-server", "llama.cpp")], tokens[("llama-server", "llama.cpp")] = rate, peer
    if llama_bench:
        best[("llama-bench", "llama.cpp")] = llama_bench_decode(
            llama_bench, gguf, n_tokens, torch.get_num_threads()
        )
    rows = []
    for (variant, step), r in best.items():
        rows.append(
            {
                "variant": variant,
                "step": step,
                "tokens": n_tokens,
                "tok_s": round(r, 1),
                "vs_llama_server": round(r / best[("llama-server", "llama.cpp")], 2),
                # llama-bench decodes from an empty context: no tokens to compare
                "tokens_vs_llama_server": agreement(tokens[(variant, step)], peer)
                if (variant, step) in tokens
                else "n/a (empty context)",
                "fused_vs_ops": parted.get(variant, "n/a"),
                "top2_gap_there": gaps.get(variant, ""),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, action="append", help="decode rows (repeatable; default 1 4 16)")
    ap.add_argument("--weights", action="append", choices=("q4_1", "fp32"))
    ap.add_argument("--reps", type=int, default=12, help="steps timed per engine, best taken")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", type=Path, default=CSV)
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary: writes day-61-peer.csv")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (a row of day-61-peer.csv)")
    ap.add_argument("--peer-only", action="store_true", help="only day-61-peer.csv")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print(cpu_line())
    if args.llama_server:
        peer = peer_table(args.llama_server, args.llama_bench)
        for row in peer:
            print(row)
        print(f"wrote {write_csv(peer, PEER_CSV, cpu=True)}")
    if args.peer_only:
        return
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for weights in args.weights or ["q4_1", "fp32"]:
        model, tok = load(weights)
        for n in args.rows or [1, 4, 16]:
            for row in measure(model, tok, weights, n, args.reps, bandwidth):
                row["bandwidth_gbs"] = round(bandwidth, 1)
                print(row)
                rows.append(row)
        if weights == "fp32" and not args.no_compile:
            crow = compile_row(model, tok, args.reps)
            print(crow)
            write_csv([crow], COMPILE_CSV, cpu=True)
    write_csv(rows, args.out, cpu=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
