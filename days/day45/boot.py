"""Day 45: the boot path, from a config to a listening server, and the configs it refuses.

Three tables, each written next to this file:

* `day-45-refusals.csv`: bad configs handed to `build_engine`. Per config: the sentence it was
  refused with, which check refused it, and which phases `on_phase` had reported by then (none
  means nothing was loaded), with this run's time to the refusal.
* `day-45-cli.csv`: bad options given to the real command, `python -m nanoserve serve ...`, as a
  subprocess: its exit code, how many lines it wrote to stderr, whether one was a traceback, and
  the line itself.
* `day-45-serve.csv`: one real boot of `python -m nanoserve serve` (the default model's fp32
  weights), watched from outside: every line it writes to stderr and every change of what
  `GET /health` answers, with the seconds since launch; then one completion, SIGTERM, and the
  exit code.

The engine is the one of day 45 (`engine_config(45, ...)`, and the same ways given to the
command as options: the prefill-first schedule, the gather read of the KV pool, plain linears, a
decode step of torch ops, no recorded graphs).

    python days/day45/boot.py                    # all three tables
    python days/day45/boot.py --only serve --max-batch 8
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from nanocourse import REPO, cpu_line, engine_config, write_csv
from nanoserve.engine import build_engine

HERE = Path(__file__).resolve().parent

# the day's config (on top of engine_config(45)): small enough to boot in seconds on 2 cores
BASE = dict(max_batch=4, max_model_len=512, kv_budget=64 * 2**20)

# the command-line options that give `nanoserve serve` the engine of day 45 (its defaults are the
# finished engine's: packed or quantized weights, the native kernel, mixed steps, recorded graphs)
DAY_OPTIONS = (
    "--weights", "dtype", "--linear", "plain", "--attention", "gather", "--schedule", "prefill-first",
    "--decode-step", "ops", "--watermark", "0.05", "--no-capture",
)  # fmt: skip

# (name, the fields that differ from BASE)
BAD_CONFIGS = [
    ("max_batch 0", {"max_batch": 0}),
    ("dtype fp16", {"dtype": "float16"}),
    ("block_size 0", {"block_size": 0}),
    ("watermark 1.5", {"watermark": 1.5}),
    ("max_model_len 1", {"max_model_len": 1}),
    ("max_model_len 100000", {"max_model_len": 100_000}),
    ("KV budget of 1 MiB", {"kv_budget": 2**20}),
]

BAD_OPTIONS = [
    ("--max-batch", "0"),
    ("--port", "70000"),
    ("--kv-budget", "lots"),
    ("--model", "/nonexistent/model"),
    ("--schedule", "fastest"),
]


def refusal_row(name: str, change: dict, model_dir=None) -> dict:
    """Hand one bad config to build_engine; what refused it, and how far the boot had got."""
    phases = []
    config = engine_config(45, **{**BASE, "model": str(model_dir) if model_dir else None, **change})
    t0 = time.perf_counter()
    try:
        build_engine(config, on_phase=phases.append)
        error = ""
    except (ValueError, Exception) as e:  # noqa: BLE001 -- the table records whatever came back
        error = f"{type(e).__name__}: {e}"
    ms = 1000 * (time.perf_counter() - t0)
    return {
        "config": name,
        "phases_before": " ".join(phases) or "none",
        "refused": "before loading" if not phases else "after loading",
        "error": error,
        "ms": round(ms, 1),
        "cpu": cpu_line(),  # the machine the time was taken on
    }


def refusal_table(model_dir=None) -> list[dict]:
    return [refusal_row(name, change, model_dir) for name, change in BAD_CONFIGS]


def nanoserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nanoserve.cli", "serve", *args]


def cli_row(option: str, value: str) -> dict:
    r = subprocess.run(nanoserve_cmd(option, value), capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = r.stderr.strip().splitlines()
    return {
        "option": f"{option} {value}",
        "exit_code": r.returncode,
        "stderr_lines": len(lines),
        "traceback": "yes" if "Traceback" in r.stderr else "no",
        "message": lines[-1] if lines else "",
    }


def cli_table() -> list[dict]:
    return [cli_row(o, v) for o, v in BAD_OPTIONS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_status(url: str) -> str:
    try:
        r = httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return "no answer"
    return f"{r.status_code} {r.json()['status']}"


def serve_table(max_batch: int = 4, threads: int = 1) -> list[dict]:
    """Launch `nanoserve serve`, watch its stderr and /health until it is ready, send one
    completion, stop it with SIGTERM; one row per stderr line and per /health change."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = nanoserve_cmd(
        "--port", str(port), "--max-batch", str(max_batch), "--max-model-len", "512",
        "--kv-budget", "64MiB", "--threads", str(threads), "--no-access-log", *DAY_OPTIONS,
    )  # fmt: skip
    rows, t0, lock = [], time.perf_counter(), threading.Lock()

    def add(source: str, what: str) -> None:
        with lock:
            rows.append({"t_s": round(time.perf_counter() - t0, 2), "source": source, "what": what})

    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=REPO)

    def read_stderr() -> None:
        for line in proc.stderr:
            add("stderr", line.rstrip("\n").replace(str(port), "PORT"))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    last = None
    deadline = time.monotonic() + 300
    while last != "200 ok" and time.monotonic() < deadline and proc.poll() is None:
        status = health_status(url)
        if status != last:
            add("health", status)
            last = status
        time.sleep(0.02)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    add("client", f"POST /v1/completions -> {r.status_code}, {r.json()['usage']['completion_tokens']} tokens")
    proc.send_signal(signal.SIGTERM)
    add("client", "SIGTERM sent")
    code = proc.wait(timeout=60)
    reader.join(timeout=10)
    add("process", f"exit code {code}")
    after = health_status(url)
    add("health", after)
    rows.sort(key=lambda r: r["t_s"])
    for i, row in enumerate(rows):
        row["n"] = i
    cpu = cpu_line()  # the machine the times were taken on
    return [
        {"n": r["n"], "source": r["source"], "what": r["what"], "t_s": r["t_s"], "cpu": cpu} for r in rows
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["refusals", "cli", "serve"], default=None)
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-batch", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.only in (None, "refusals"):
        rows = refusal_table(args.model)
        for r in rows:
            print(r)
        print("wrote", write_csv(rows, HERE / "day-45-refusals.csv"))
    if args.only in (None, "cli"):
        rows = cli_table()
        for r in rows:
            print(r)
        print("wrote", write_csv(rows, HERE / "day-45-cli.csv"))
    if args.only in (None, "serve"):
        rows = serve_table(args.max_batch)
        for r in rows:
            print(r)
        print("wrote", write_csv(rows, HERE / "day-45-serve.csv"))


if __name__ == "__main__":
    main()
