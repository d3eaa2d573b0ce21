"""Day 44: backpressure. What the server refuses, when, and with which status, counted.

`create_app(engine)` is served by uvicorn on a free port of 127.0.0.1 in a thread of this
process (`course.ServerThread`), in front of the tiny random-weight Llama (no tokenizer: prompts
are token ids). Every request goes through httpx. Three limits are probed, one CSV each.

* `day-44-queue.csv`: the waiting queue. A `PausedEngine` takes requests but runs none of them
  while it is paused, so every admitted request stays in the scheduler's waiting queue and the
  queue length is exactly the number admitted. Requests are sent one at a time; each is either
  admitted (the queue grows by one) or refused at once. With `max_waiting` W the first W are
  admitted and every later one gets 429. Then the engine is released, the admitted ones finish
  with 200, and one more request (the queue now empty) gets 200 too.
* `day-44-body.csv`: the body cap. Bodies of exactly the cap and one byte over, sent with a
  Content-Length and chunked (no length): over the cap is 413, at the cap is served.
* `day-44-drain.csv`: a graceful shutdown (`serve.drain`) with requests in flight. While it
  drains, /health is 503 "draining" and a new request is 503 with Retry-After. With a drain
  timeout long enough, the requests in flight finish with 200 and none is cut; with a short one
  and an engine still paused, all are cut with 503 at the timeout.
* `day-44-overload.csv`: what a queue limit does to TTFT. The engine runs (not paused) with
  `max_batch` 2, and `loadgen.run_open_loop` sends it requests at Poisson times at `--rate`, a
  rate above what it serves, so a queue builds. Once with the server's default limit (1024:
  every request waits its turn) and once with `--overload-waiting`: the served requests' TTFT
  and TPOT, how many were refused with 429, and the goodput under `--slo-ttft-ms`/`--slo-tpot-ms`.

The engine is the one of day 44 (`engine_config(44, ...)`: the prefill-first schedule, the
gather read of the KV pool, plain linears, a decode step of torch ops).

    python days/day44/backpressure.py                      # writes the four CSVs
    python days/day44/backpressure.py --max-waiting 0 1 2 4 8 --extra 3
    python days/day44/backpressure.py --rate 100 --overload-requests 96 --overload-waiting 2 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from nanocourse import ServerThread, cpu_line, engine_config, tiny_llama, write_csv
from nanoserve import loadgen
from nanoserve.engine import Engine
from nanoserve.serve import create_app, drain

HERE = Path(__file__).resolve().parent
MODEL = "tiny-llama"
JSON = {"content-type": "application/json"}
MAX_TOKENS = 8  # each admitted request asks this many tokens (ignore_eos: it gets them all)
DEFAULT_WAITING = 1024  # create_app's max_waiting when none is given
SLO_TTFT_MS, SLO_TPOT_MS = 250.0, 25.0  # the objective of day 43's open-loop table


class PausedEngine(Engine):
    """An Engine whose step does nothing while `paused` is set: requests are taken into the
    waiting queue, none is scheduled. It stands in for an engine too busy to start them."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.paused = threading.Event()
        self.paused.set()

    def step(self):
        if self.paused.is_set():
            time.sleep(0.002)
            return []
        return super().step()


def make_engine(model, rows: int = 1, blocks: int = 64) -> PausedEngine:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    config = engine_config(44, max_batch=rows, max_model_len=128, kv_budget=blocks * per_block)
    engine = PausedEngine(model, None, config)
    engine.model_name = MODEL
    return engine


def body(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": MODEL, "prompt": [17 + i, 18, 19, 20], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


class Sent:
    """One request on its own thread; `.response` once it has an answer."""

    def __init__(self, url: str, payload: dict | bytes, path: str = "/v1/completions", timeout: float = 60):
        self.response: httpx.Response | None = None
        kw = {"content": payload, "headers": JSON} if isinstance(payload, bytes) else {"json": payload}
        self.thread = threading.Thread(
            target=lambda: setattr(self, "response", httpx.post(url + path, timeout=timeout, **kw)),
            daemon=True,
        )
        self.thread.start()

    def join(self, timeout: float = 60) -> httpx.Response:
        self.thread.join(timeout)
        return self.response


def send_until_taken(url: str, engine: Engine, payload: dict, timeout: float = 10) -> tuple[Sent, bool]:
    """Send one request and wait until the engine took it (its waiting queue grew) or the server
    answered (a refusal). Returns the request and whether it was taken."""
    before = len(engine.scheduler.waiting)
    sent = Sent(url, payload)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(engine.scheduler.waiting) > before:
            return sent, True
        if not sent.thread.is_alive():
            return sent, False
        time.sleep(0.002)
    raise RuntimeError("the request was neither taken nor answered")


def probe_queue(model, max_waiting: int, extra: int = 2) -> tuple[dict, list[dict]]:
    """Send max_waiting + extra requests to a paused engine, one at a time; then release it."""
    engine = make_engine(model)
    log, taken = [], []
    with ServerThread(create_app(engine, max_waiting=max_waiting)) as url:
        for i in range(max_waiting + extra):
            waiting_before = len(engine.scheduler.waiting)
            sent, was_taken = send_until_taken(url, engine, body(i))
            r = None if was_taken else sent.response
            log.append({"max_waiting": max_waiting, "request": i, "waiting_before": waiting_before,
                        "taken": was_taken, "status": r.status_code if r is not None else None,
                        "retry_after": (r.headers.get("retry-after") or "") if r is not None else "",
                        "message": r.json()["error"]["message"] if r is not None else ""})  # fmt: skip
            if was_taken:
                taken.append((i, sent))
        engine.paused.clear()  # the engine gets to work: the admitted requests run to the end
        for i, sent in taken:
            r = sent.join()
            log[i]["status"] = r.status_code
        after = httpx.post(url + "/v1/completions", json=body(99), timeout=60)
    refused = [row for row in log if row["status"] == 429]
    row = {
        "max_waiting": max_waiting,
        "sent": len(log),
        "admitted": len(taken),
        "status_200": sum(row["status"] == 200 for row in log),
        "status_429": len(refused),
        "first_429": refused[0]["request"] if refused else "",
        "retry_after_on_429": refused[0]["retry_after"] or "none" if refused else "",
        "after_release": after.status_code,
    }
    return row, log


def exact_body(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (JSON padded with spaces)."""
    raw = json.dumps({"model": MODEL, "prompt": [17, 18], "max_tokens": 1}).encode()
    assert len(raw) <= size, f"the smallest body is {len(raw)} bytes"
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


def chunked(data: bytes, piece: int = 64):
    for i in range(0, len(data), piece):
        yield data[i : i + piece]


def probe_body(model, cap: int = 256) -> list[dict]:
    engine = make_engine(model)
    engine.paused.clear()
    rows = []
    with ServerThread(create_app(engine, max_body_bytes=cap)) as url:
        for size in (cap, cap + 1):
            for framing in ("content-length", "chunked"):
                data = exact_body(size)
                content = data if framing == "content-length" else chunked(data)
                r = httpx.post(url + "/v1/completions", content=content, headers=JSON, timeout=30)
                error = r.json().get("error") or {}
                rows.append({"cap_bytes": cap, "body_bytes": len(data), "framing": framing,
                             "status": r.status_code, "code": error.get("code") or ""})  # fmt: skip
    return rows


def probe_drain(model, in_flight: int = 3, timeout: float = 10.0, release: bool = True) -> dict:
    """`in_flight` requests taken by a paused engine, then `drain(state, timeout)` on a thread.
    While it drains: /health and one new request. Then the engine is released (or not)."""
    engine = make_engine(model, rows=in_flight)
    app = create_app(engine)
    state = app.state.nanoserve
    with ServerThread(app) as url:
        sent = [send_until_taken(url, engine, body(i))[0] for i in range(in_flight)]
        result = {}
        drainer = threading.Thread(
            target=lambda: result.setdefault("cut", drain(state, timeout)), daemon=True
        )
        drainer.start()
        while state.phase != "draining":
            time.sleep(0.002)
        health = httpx.get(url + "/health", timeout=10)
        new = httpx.post(url + "/v1/completions", json=body(50), timeout=10)
        if release:
            engine.paused.clear()
        drainer.join(timeout + 30)
        answers = [s.join() for s in sent]
    return {
        "drain_timeout_s": timeout,
        "released": "yes" if release else "no",
        "in_flight": in_flight,
        "health_code": health.status_code,
        "health_status": health.json()["status"],
        "health_in_flight": health.json().get("in_flight"),
        "new_request": new.status_code,
        "new_retry_after": new.headers.get("retry-after") or "none",
        "status_200": sum(r.status_code == 200 for r in answers),
        "status_503": sum(r.status_code == 503 for r in answers),
        "drain_cut": result["cut"],
    }


def overload_workload(n: int, seed: int = 0) -> list[loadgen.LoadRequest]:
    """n completions of 4-24 random ids asking 8-24 tokens (ids 17-255: the tiny vocab)."""
    return loadgen.token_workload(n, prompt_len=(4, 24), output_len=(8, 24), vocab=256, seed=seed)


def probe_overload(model, rate: float, n: int = 48, max_waiting: int = DEFAULT_WAITING, rows: int = 2,
                   seed: int = 0, slo: tuple[float, float] = (SLO_TTFT_MS, SLO_TPOT_MS)) -> dict:  # fmt: skip
    """n requests at Poisson times at `rate` per second to a running engine of `rows` rows
    behind a queue of `max_waiting`; what the served ones saw, and how many were refused."""
    engine = make_engine(model, rows=rows)
    engine.paused.clear()
    with ServerThread(create_app(engine, max_waiting=max_waiting)) as url:
        reqs = overload_workload(n, seed)
        with ThreadPoolExecutor(1) as pool:  # an event loop of its own (a notebook runs one already)
            report = pool.submit(
                asyncio.run, loadgen.run_open_loop(url, reqs, rate=rate, seed=seed, model=MODEL)
            ).result()
    s = loadgen.summarize(report)
    g = loadgen.goodput(report, ttft_ms=slo[0], tpot_ms=slo[1])
    rs = report.results
    return {
        "max_waiting": max_waiting,
        "request_rate": rate,
        "requests": len(rs),
        "status_200": sum(r.complete for r in rs),
        "status_429": sum((r.error or "").startswith("HTTP 429") for r in rs),
        "other": sum(not r.complete and not (r.error or "").startswith("HTTP 429") for r in rs),
        "peak_in_flight": report.concurrency,
        "seconds": s["seconds"],
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p99_ms": s["ttft_p99_ms"],
        "ttft_max_ms": round(1000 * max((r.ttft for r in rs if r.ttft is not None), default=float("nan")), 1),
        "tpot_p50_ms": s["tpot_p50_ms"],
        **{k: g[k] for k in ("slo_ttft_ms", "slo_tpot_ms", "good", "goodput_req_s")},
        "cpu": cpu_line(),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-waiting", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--extra", type=int, default=2, help="requests sent past each queue limit")
    ap.add_argument("--cap", type=int, default=256, help="the body cap probed, in bytes")
    ap.add_argument("--in-flight", type=int, default=3, help="requests in flight when the drain starts")
    ap.add_argument("--short-timeout", type=float, default=0.3, help="the drain timeout that cuts")
    ap.add_argument("--rate", type=float, default=256.0, help="overload: arrivals per second")
    ap.add_argument("--overload-requests", type=int, default=48)
    ap.add_argument("--overload-waiting", type=int, nargs="+", default=[4], help="queue limits to compare")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_llama(0)
    queue_rows, logs = [], []
    for w in args.max_waiting:
        row, log = probe_queue(model, w, args.extra)
        queue_rows.append(row)
        logs += log
    drains = [
        probe_drain(model, args.in_flight, timeout=10.0, release=True),
        probe_drain(model, args.in_flight, timeout=args.short_timeout, release=False),
    ]
    overload = [
        probe_overload(model, args.rate, args.overload_requests, w)
        for w in [DEFAULT_WAITING, *args.overload_waiting]
    ]
    tables = (("queue", queue_rows), ("body", probe_body(model, args.cap)), ("drain", drains),
              ("overload", overload))  # fmt: skip
    for name, rows in tables:
        path = write_csv(rows, args.out / f"day-44-{name}.csv")
        print(path.name)
        for r in rows:
            print("  ", r)


if __name__ == "__main__":
    main()
