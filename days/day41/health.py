"""Day 41: `/health` and the pool plan. Every state the route reports, produced for real.

`create_app` is served by uvicorn on a free port of 127.0.0.1 in a thread of this process
(`nanocourse.ServerThread`), in front of the tiny random-weight Llama (no tokenizer: prompts are token
ids). Every request goes through httpx or the `openai` client. Nothing here waits on a clock:
the slow builder and the held engine move on only when an explicit `threading.Event` is set,
and every wait has a deadline that raises with a sentence when it passes.

* `day-41-states.csv`: one server walked through its life (loading, warming, ready, one request
  waiting, draining), then two that fail (a builder that raises, an engine loop that dies). At
  each point: what `/health` answered and what a completion got.
* `day-41-pool.csv`: the pool plan in `/health`'s 200 body for a few budgets and block sizes,
  next to `plan_pool` of the same numbers (they must be equal) and our own arithmetic.
* `day-41-client.csv`: a client that polls `/health` and sends its first request at the first
  200, against the real route and against a planted one that answers 200 while warming.

    python days/day41/health.py                 # writes the three CSVs next to this file
    python days/day41/health.py --blocks 8 32 128 --block-sizes 8 16 32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import threading
import time
from pathlib import Path

import httpx
import openai
import torch
from fastapi.responses import JSONResponse

from nanocourse import ServerThread, engine_config, tiny_llama, write_csv
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.pool import plan_pool
from nanoserve.serve import create_app, drain

HERE = Path(__file__).resolve().parent
MODEL = "tiny-llama"
PROMPT = [17, 18, 19, 20]
WAIT = 20.0  # seconds any wait may take before it raises


def wait_until(predicate, what: str, timeout: float = WAIT) -> None:
    """Poll `predicate` every 5 ms; raise with `what` if it is still false after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}; it did not happen")
        time.sleep(0.005)


class HeldEngine(Engine):
    """An Engine whose step does nothing until `go` is set: requests it takes stay waiting."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.go = threading.Event()
        self.go.set()

    def step(self):
        if not self.go.wait(0.005):
            return []
        return super().step()


def pool_config(blocks: int = 32, block_size: int = 16, max_model_len: int = 128) -> EngineConfig:
    """The engine of day 41 with a pool of exactly `blocks` blocks of `block_size` tokens."""
    per_slot = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head dim 16 x fp32 bytes
    budget = blocks * block_size * per_slot + per_slot  # exactly `blocks` blocks and the sink slot
    return engine_config(
        41, max_batch=2, max_model_len=max_model_len, block_size=block_size, kv_budget=budget
    )


def make_engine(model, **kw) -> HeldEngine:
    """The tiny model's engine, held or let go by its `go` event."""
    engine = HeldEngine(model, None, pool_config(**kw))
    engine.model_name = MODEL
    return engine


class HeldBuilder:
    """A builder for `create_app` that reports each phase and stops in it until that phase's
    event is set, then hands back a prebuilt engine. "warming" is where a builder warms the engine
    up; day 55 builds that warm-up, so this one only reports the phase and waits."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.gates = {"loading": threading.Event(), "warming": threading.Event()}
        self.reached: list[str] = []

    def release(self, phase: str) -> None:
        self.gates[phase].set()

    def release_all(self) -> None:
        for gate in self.gates.values():
            gate.set()

    def __call__(self, on_phase) -> Engine:
        for phase in ("loading", "warming"):
            on_phase(phase)
            self.reached.append(phase)
            if not self.gates[phase].wait(WAIT):
                raise TimeoutError(f"nobody released the builder from '{phase}' within {WAIT:g} s")
        return self.engine


def shut(server: ServerThread, app, builder: HeldBuilder | None = None) -> None:
    """Let the builder finish (it prints the boot line and starts the engine loop when it
    returns), then stop the server, whose lifespan stops that loop: no thread outlives it."""
    if builder is not None:
        builder.release_all()
    thread = app.state.build_thread
    if thread is not None:
        thread.join(WAIT)
        if thread.is_alive():
            raise TimeoutError(f"the builder was still running {WAIT:g} s after its release")
    server.__exit__(None, None, None)


def body(i: int = 0, max_tokens: int = 4) -> dict:
    return {"model": MODEL, "prompt": [p + i for p in PROMPT], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


class Sent:
    """One completion on its own thread; `.join()` returns its response."""

    def __init__(self, url: str, payload: dict):
        self.response = None
        self.thread = threading.Thread(
            target=lambda: setattr(
                self, "response", httpx.post(url + "/v1/completions", json=payload, timeout=60)
            ),
            daemon=True,
        )
        self.thread.start()

    def join(self) -> httpx.Response:
        self.thread.join(WAIT)
        if self.response is None:
            raise TimeoutError(f"the request had no answer within {WAIT:g} s")
        return self.response


def observe(url: str, server: str, state: str, produced_by: str, request: bool = True) -> dict:
    """GET /health, then (if `request`) one completion; the row of day-41-states.csv."""
    h = httpx.get(url + "/health", timeout=10)
    hb = h.json()
    row = {"server": server, "state": state, "produced_by": produced_by, "health_code": h.status_code,
           "health_status": hb["status"], "health_error": hb.get("error") or "",
           "in_flight": hb.get("in_flight", ""), "waiting": hb.get("waiting", ""),
           "completion_code": "", "retry_after": "", "completion_message": ""}  # fmt: skip
    if request:
        r = httpx.post(url + "/v1/completions", json=body(), timeout=30)
        row["completion_code"] = r.status_code
        row["retry_after"] = r.headers.get("retry-after") or "none"
        row["completion_message"] = r.json()["error"]["message"] if r.status_code != 200 else ""
    row["_body"] = hb
    return row


def probe_life(model) -> list[dict]:
    """One server: loading -> warming -> ok -> ok with one waiting -> draining."""
    engine = make_engine(model)
    builder = HeldBuilder(engine)
    app = create_app(builder, address="127.0.0.1:PORT")
    state = app.state.nanoserve
    rows = []
    server = ServerThread(app)
    try:
        url = server.__enter__()
        wait_until(lambda: builder.reached == ["loading"], "the builder to report 'loading'")
        rows.append(observe(url, "life", "loading", "builder held in 'loading'"))
        builder.release("loading")
        wait_until(lambda: builder.reached == ["loading", "warming"], "the builder to report 'warming'")
        rows.append(observe(url, "life", "warming", "builder held in 'warming'"))
        builder.release("warming")
        wait_until(lambda: state.phase == "ready", "the phase to turn 'ready'")
        rows.append(observe(url, "life", "ok", "builder returned"))
        engine.go.clear()  # the engine takes the next request and runs nothing
        sent = Sent(url, body(1))
        wait_until(lambda: len(engine.scheduler.waiting) == 1, "the engine to take the request")
        rows.append(observe(url, "life", "ok", "one request waiting, engine held", request=False))
        cut = {}
        drainer = threading.Thread(target=lambda: cut.setdefault("n", drain(state, WAIT)), daemon=True)
        drainer.start()
        wait_until(lambda: state.phase == "draining", "the drain to start")
        rows.append(observe(url, "life", "draining", "drain() with that request in flight"))
        engine.go.set()  # the request in flight finishes; then the drain returns
        drainer.join(WAIT)
        in_flight = sent.join()
        rows[-1]["produced_by"] += f" (it then got {in_flight.status_code}; drain cut {cut['n']})"
    finally:
        engine.go.set()
        shut(server, app, builder)
    return rows


def probe_failed_build(model) -> dict:
    """A builder that raises: the engine refuses a pool smaller than the context."""
    failed = threading.Event()

    def builder(on_phase):
        on_phase("loading")
        return Engine(model, None, pool_config(blocks=4, max_model_len=128))  # 64 tokens < 128

    with ServerThread(create_app(builder, on_failure=lambda reason: failed.set())) as url:
        if not failed.wait(WAIT):
            raise TimeoutError("the failing builder was never reported")
        return observe(url, "build fails", "failed", "the builder raised ValueError")


def probe_dead_loop(model) -> dict:
    """The engine loop dies in its own hand-off code after a step (as tests/test_faults.py does)."""
    app = create_app(make_engine(model))

    def boom(*args):
        raise RuntimeError("planted fault in the hand-off")

    app.state.metrics.token = boom
    state = app.state.nanoserve
    with ServerThread(app) as url:
        first = httpx.post(url + "/v1/completions", json=body(), timeout=30)
        wait_until(lambda: state.phase == "failed", "the loop's death to reach /health")
        row = observe(
            url, "loop dies", "failed", f"the engine loop raised (its request got {first.status_code})"
        )
    return row


def state_table(model) -> list[dict]:
    return probe_life(model) + [probe_failed_build(model), probe_dead_loop(model)]


# --- the pool plan ---------------------------------------------------------------------------


def our_plan(budget: int, block_size: int, bytes_per_slot: int) -> tuple[int, int]:
    """Blocks and slots a budget holds, one slot kept for the sink: the arithmetic in two lines."""
    num_blocks = (budget - bytes_per_slot) // (bytes_per_slot * block_size)
    return num_blocks, num_blocks * block_size


def pool_body(plan) -> dict:
    """What /health's "pool" must be for a plan: its fields, its slot count and its sentence."""
    return dataclasses.asdict(plan) | {"num_slots": plan.num_slots, "describe": plan.describe()}


def probe_pool(model, blocks: int, block_size: int) -> dict:
    engine = make_engine(model, blocks=blocks, block_size=block_size, max_model_len=64)
    with contextlib.redirect_stderr(io.StringIO()), ServerThread(create_app(engine)) as url:
        h = httpx.get(url + "/health", timeout=10)
    got = h.json()["pool"]
    cfg = engine.config
    plan = plan_pool(model.cfg, model.dtype, block_size=cfg.block_size, budget_bytes=cfg.kv_budget)
    ours = our_plan(cfg.kv_budget, cfg.block_size, model.cfg.kv_bytes_per_token(model.dtype))
    return {"kv_budget": cfg.kv_budget, "block_size": block_size, "num_blocks": got["num_blocks"],
            "num_slots": got["num_slots"], "bytes_per_block": got["bytes_per_block"],
            "pool_bytes": got["num_blocks"] * got["bytes_per_block"] + got["bytes_per_block"] // block_size,
            "equals_plan_pool": "yes" if got == pool_body(plan) else "no",
            "equals_ours": "yes" if ours == (got["num_blocks"], got["num_slots"]) else "no",
            "_describe": got["describe"]}  # fmt: skip


def pool_table(model, blocks=(8, 32, 128), block_sizes=(8, 16, 32)) -> list[dict]:
    return [probe_pool(model, n, b) for b in block_sizes for n in blocks]


# --- the client that trusts /health ----------------------------------------------------------


def plant_liveness_health(app) -> None:
    """Planted: replace /health with a check that counts 'warming' as up (200 while the warm-up
    still runs), the way a liveness probe that only asks 'is the process there?' would."""
    state = app.state.nanoserve
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/health"]

    @app.get("/health")
    async def health():
        if state.phase in ("loading", "draining", "failed"):
            return JSONResponse({"status": state.phase}, status_code=503)
        return {"status": "ok"}  # warming answers here too: the bug


def first_request(url: str, on_poll=None, timeout: float = WAIT) -> dict:
    """The client: poll /health until it says 200, then send the first completion through the
    `openai` client (no retries). `on_poll(body)` is called after each poll."""
    seen, polls = [], 0
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"/health did not answer 200 within {timeout:g} s (it said {seen})")
        h = httpx.get(url + "/health", timeout=10)
        polls += 1
        status = h.json()["status"]
        if not seen or seen[-1] != status:
            seen.append(status)
        if h.status_code == 200:
            break
        if on_poll is not None:
            on_poll(h.json())
        time.sleep(0.005)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        code, message = 200, f"{r.usage.completion_tokens} tokens"
    except openai.APIStatusError as e:
        code, message = e.status_code, e.body["message"] if isinstance(e.body, dict) else str(e)
    return {"seen": seen, "polls": polls, "first_code": code, "first_message": message}


def check_first_request(result: dict) -> None:
    """A client that waited for 200 must be served at its first request."""
    assert result["first_code"] == 200, (
        f"/health said ok, yet the first request got {result['first_code']}: {result['first_message']}"
    )


def probe_client(model, planted: bool) -> dict:
    engine = make_engine(model)
    builder = HeldBuilder(engine)
    app = create_app(builder)
    if planted:
        plant_liveness_health(app)
    state = app.state.nanoserve
    server = ServerThread(app)
    try:
        url = server.__enter__()
        wait_until(lambda: builder.reached == ["loading"], "the builder to report 'loading'")

        def on_poll(b):  # a phase the client has seen may end: the builder moves on
            if b["status"] in builder.gates:
                builder.release(b["status"])

        result = first_request(url, on_poll)
        result["phase_at_first_request"] = state.phase
        try:
            check_first_request(result)
            result["caught"] = ""
        except AssertionError as e:
            result["caught"] = str(e)
    finally:
        shut(server, app, builder)
    return {
        "health": "planted: 200 while warming" if planted else "create_app's",
        "statuses_seen": " > ".join(result["seen"]),
        "phase_at_first_request": result["phase_at_first_request"],
        "first_request": result["first_code"],
        "first_message": result["first_message"],
        "check_first_request": "fails" if result["caught"] else "passes",
        "_polls": result["polls"],
    }


def client_table(model) -> list[dict]:
    return [probe_client(model, planted=False), probe_client(model, planted=True)]


def public(rows: list[dict]) -> list[dict]:
    """The rows as the CSVs hold them: keys starting with '_' are for the notebook only."""
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--blocks", type=int, nargs="+", default=[8, 32, 128], help="pool sizes probed, in blocks"
    )
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_llama(0, max_position_embeddings=256)
    with contextlib.redirect_stderr(io.StringIO()):  # boot lines and the failed builder's line
        tables = {
            "states": state_table(model),
            "pool": pool_table(model, args.blocks, args.block_sizes),
            "client": client_table(model),
        }
    for name, rows in tables.items():
        path = write_csv(public(rows), args.out / f"day-41-{name}.csv")
        print(path.name)
        for r in public(rows):
            print("  ", r)


if __name__ == "__main__":
    main()
