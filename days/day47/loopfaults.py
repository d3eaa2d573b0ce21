"""Day 47: the engine loop under planted faults, seen through a real server.

`create_app(engine)` starts one thread, the engine loop (`nanoserve.loop.EngineLoop`), which
alone steps the engine; handlers talk to it only through its inbox and their own queues. Each
scenario boots a fresh server on loopback with the tiny random-weight Llama, sends the same
three concurrent greedy completions, plants its fault once all three are decoding, and then
asks `/health` and sends one more request. Per scenario (`day-47-faults.csv`): how the three
ended (status codes), the error they got, which threads stepped the engine, what `/health`
said afterwards and what a new request got; and this run's longest wait for an answer.

    python days/day47/loopfaults.py                  # writes day-47-faults.csv next to this file
    python days/day47/loopfaults.py --max-tokens 200
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from nanocourse import ServerThread, cpu_line, engine_config, tiny_llama, write_csv
from nanoserve.engine import Engine
from nanoserve.serve import create_app

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-47-faults.csv"
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


class PlantedFatal(BaseException):
    """Not an Exception: nothing that catches `Exception` stops it, as with a KeyboardInterrupt."""


def make_engine(model, rows: int = 4, blocks: int = 64) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    config = engine_config(
        47, max_batch=rows, max_model_len=256, kv_budget=blocks * per_block + per_block // 16
    )
    engine = Engine(model, None, config)
    engine.model_name = "tiny-llama"
    return engine


def plant(engine: Engine, app, fault: str, stepped: set) -> None:
    """Wrap the engine's step (and, for "hand-off", the metrics the loop updates after it) so
    that the fault fires once, on the first step at which every request is decoding."""
    real_step, fired = engine.step, []

    def ready() -> bool:
        running = engine.scheduler.running
        return len(running) == len(PROMPTS) and all(len(s.output_ids) >= 2 for s in running)

    def step():
        stepped.add(threading.current_thread().name)
        if fault in ("step raises", "step raises fatally") and not fired and ready():
            fired.append(1)
            if fault == "step raises":
                raise RuntimeError("planted fault in step")
            raise PlantedFatal("planted fatal fault in step")
        return real_step()

    engine.step = step
    if fault == "hand-off raises":
        real_token = app.state.metrics.token

        def token(*args):
            if not fired and ready():
                fired.append(1)
                raise RuntimeError("planted fault in the hand-off")
            return real_token(*args)

        app.state.metrics.token = token


def ask(url: str, prompt, max_tokens: int) -> tuple[int, str, float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    error = r.json()["error"]["message"] if r.status_code != 200 else ""
    return r.status_code, error, time.perf_counter() - t0


def scenario(fault: str, max_tokens: int = 60, step_sleep: float = 0.005) -> dict:
    engine = make_engine(tiny_llama(0))
    app = create_app(engine)
    stepped: set = set()
    plant(engine, app, fault, stepped)
    real = engine.step
    engine.step = lambda: (time.sleep(step_sleep), real())[1]  # slow enough for all three to join
    with ServerThread(app) as url:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: ask(url, p, max_tokens), PROMPTS))
        health = httpx.get(url + "/health", timeout=10)
        after = ask(url, [5, 6, 7], 4)
    body = health.json()
    errors = sorted({e for _, e, _ in answers if e})
    return {
        "fault": fault,
        "statuses": " ".join(str(s) for s, _, _ in answers),
        "error": errors[0] if errors else "",
        "stepped_by": " ".join(sorted(stepped)),
        "health_after": f"{health.status_code} {body['status']}",
        "health_error": body.get("error") or "",
        "new_request": after[0],
        "blocks_used_after": engine.allocator.num_used,
        "longest_wait_s": round(max(w for _, _, w in answers), 2),
        "cpu": cpu_line(),  # the machine the wait was timed on
    }


FAULTS = ["none", "step raises", "step raises fatally", "hand-off raises"]


def fault_table(max_tokens: int = 60) -> list[dict]:
    return [scenario(f, max_tokens) for f in FAULTS]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--out", default=str(CSV))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = fault_table(args.max_tokens)
    for r in rows:
        print(r)
    print("wrote", write_csv(rows, args.out))


if __name__ == "__main__":
    main()
