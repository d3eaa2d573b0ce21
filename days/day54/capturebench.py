"""Day 54's benchmark: lazy decode capture on the host, counted and timed (no weights needed).

A tiny random-weight Llama decodes `rows` requests in lockstep off `prompt_len`-token prompts
at a given width multiple, once with `capture_decode` off (persistent inputs, eager decode) and
once with it on (one `HostGraph` recorded per (rows, width) shape, lazily, then replayed). For
each generated length the table says how many graphs the captured run recorded in front of its
requests, what `nanoserve.warmup.lazy_captures` predicts, whether the tokens are the eager
run's, and what a decode step cost eagerly, when recording and when replaying. The timing
columns are CPU wall clock: a `HostGraph` replay re-runs the step, so it saves nothing here;
the saving of a CUDA graph is launch overhead, which only a GPU has.

    python days/day54/capturebench.py                                 # the committed CSV
    python days/day54/capturebench.py --lengths 8 64 512 --rows 8     # a bigger sweep
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_config, tiny_llama, write_csv
from nanoserve.engine import Engine
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams
from nanoserve.warmup import lazy_captures

HERE = Path(__file__).resolve().parent
TINY = tiny_config(max_position_embeddings=1024)


def tiny_model(seed: int = 0) -> Llama:
    return tiny_llama(seed, 0.05, TINY.max_position_embeddings)


def make_engine(model, capture: bool, rows: int, max_model_len: int, width_multiple: int) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * 16
    config = engine_config(
        54,  # the engine as of day 54: prefill-first, gather attention, plain linears, ops step
        max_batch=rows,
        max_model_len=max_model_len,
        kv_budget=per_block * (rows * max_model_len // 16 + rows + 1),
        width_multiple=width_multiple,
        bucket_decode=True,
        persist_inputs=True,
        capture_decode=capture,
    )
    return Engine(model, None, config)


def time_steps(eng: Engine) -> list[tuple[str, float]]:
    """Wrap the runner so every decode step is logged as (kind, seconds): kind is "eager",
    "record" (a cold capture) or "replay"."""
    log, runner, execute = [], eng.runner, eng.runner.execute

    def timed(plan):
        if not plan.is_decode:
            return execute(plan)
        cold = runner.cold_captures
        t0 = time.perf_counter()
        out = execute(plan)
        seconds = time.perf_counter() - t0
        kind = "eager" if not runner.capture else ("record" if runner.cold_captures > cold else "replay")
        log.append((kind, seconds))
        return out

    runner.execute = timed
    return log


def prompts(rows: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """`rows` different prompts of the same length, so the requests decode in lockstep."""
    return [[(7 * r + 3 * i + 1) % vocab for i in range(prompt_len)] for r in range(rows)]


def run(model, generated: int, capture: bool, rows=3, prompt_len=16, width_multiple=16) -> dict:
    eng = make_engine(model, capture, rows, prompt_len + generated, width_multiple)
    log = time_steps(eng)
    outs = eng.generate(
        prompts(rows, prompt_len, model.cfg.vocab_size),
        SamplingParams(max_tokens=generated, ignore_eos=True),
        use_tqdm=False,
    )
    return {
        "tokens": [o.token_ids for o in outs],
        "graphs": sorted(eng.runner.graphs),
        "cold": eng.runner.cold_captures,
        "log": log,
        "engine": eng,
    }


def ms(log, kind) -> float:
    times = [s for k, s in log if k == kind]
    return round(statistics.median(times) * 1000, 3) if times else float("nan")


def capture_table(
    lengths=(8, 32, 64, 128), rows=3, prompt_len=16, width_multiple=16, model=None
) -> list[dict]:
    model = model or tiny_model()
    out = []
    for n in lengths:
        eager = run(model, n, False, rows, prompt_len, width_multiple)
        captured = run(model, n, True, rows, prompt_len, width_multiple)
        steps = len(captured["log"])
        out.append(
            {
                "generated": n,
                "decode_steps": steps,
                "graphs": len(captured["graphs"]),
                "cold_captures": captured["cold"],
                "predicted": lazy_captures(n, width_multiple, prompt_len=prompt_len),
                "replays": steps - captured["cold"],
                "same_tokens": "yes" if captured["tokens"] == eager["tokens"] else "no",
                "eager_step_ms": ms(eager["log"], "eager"),
                "record_step_ms": ms(captured["log"], "record"),
                "replay_step_ms": ms(captured["log"], "replay"),
            }
        )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 64, 128], help="tokens generated")
    ap.add_argument("--rows", type=int, default=3, help="requests decoding together")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--width-multiple", type=int, default=16)
    ap.add_argument("--out", type=Path, default=HERE / "day-54-capturebench.csv")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = capture_table(tuple(args.lengths), args.rows, args.prompt_len, args.width_multiple)
    for row in rows:
        assert row["cold_captures"] == row["predicted"] and row["same_tokens"] == "yes", row
    write_csv(rows, args.out, cpu=True)
    for row in rows:
        print(row)
    print(f"{args.out.name} written in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
