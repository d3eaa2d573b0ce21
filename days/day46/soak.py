"""Day 46: a soak test of the server in which nothing may be lost.

One server on loopback (the tiny random-weight Llama, no tokenizer, prompts as token ids),
and many clients at once, each on its own thread: healthy ones (streaming or not), ones that
read a few events of a long stream and hang up, and ones that send a bad body. Afterwards every
request is accounted for: each client's outcome (finished, aborted, refused with its status
code) is tabulated, the server's own count of ended requests (`/metrics`,
`nanoserve_requests` by finish reason) must equal the clients' counts, every KV block must be
back (`/health` says 0 used, `BlockAllocator.check_invariants` passes with no live tables), and
the healthy clients' tokens must equal a clean run of the same prompts on an engine nobody
else used. `--leak` plants a scheduler that forgets to free an aborted request's blocks; the
same check then fails.

    python days/day46/soak.py        # writes day-46-soak.csv, day-46-ledger.csv, day-46-clients.csv
    python days/day46/soak.py --rounds 4 --clients 64
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from nanocourse import ServerThread, cpu_line, engine_config, tiny_llama, write_csv
from nanoserve.engine import Engine
from nanoserve.sampling import SamplingParams
from nanoserve.serve import create_app

HERE = Path(__file__).resolve().parent
HEALTHY_TOKENS, LONG_TOKENS, HANG_UP_AFTER = 24, 200, 3
# bad bodies: each must be refused before it reaches the engine (what, body)
BAD = [
    ("max_tokens -1", {"prompt": [5, 6, 7], "max_tokens": -1}),
    ("prompt past the context", {"prompt": [5] * 300, "max_tokens": 4}),
    ("temperature not a number", {"prompt": [5, 6], "max_tokens": 4, "temperature": "hot"}),
    ("no prompt", {"max_tokens": 4}),
    ("token id past the vocabulary", {"prompt": [5, 999], "max_tokens": 4}),
    ("not JSON", b"{not json"),
]


def make_engine(model, rows: int = 4, blocks: int = 64) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    config = engine_config(
        46, max_batch=rows, max_model_len=256, kv_budget=blocks * per_block + per_block // 16
    )
    engine = Engine(model, None, config)
    engine.model_name = "tiny-llama"
    return engine


def plan_clients(n: int, seed: int = 0) -> list[dict]:
    """n clients, in a shuffled order: half healthy (alternately streaming), a quarter hanging up
    mid-stream, a quarter sending a bad body."""
    rng = random.Random(seed)
    clients = []
    for i in range(n):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 12))]
        if i % 4 in (0, 1):
            kind = "healthy-stream" if i % 8 < 4 else "healthy"
            body = {"prompt": prompt, "max_tokens": HEALTHY_TOKENS, "temperature": 0, "ignore_eos": True}
            clients.append({"kind": kind, "body": body})
        elif i % 4 == 2:
            body = {"prompt": prompt, "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}
            clients.append({"kind": "hang-up", "body": body})
        else:
            what, body = BAD[(i // 4) % len(BAD)]
            clients.append({"kind": "bad", "what": what, "body": body})
    rng.shuffle(clients)
    for i, c in enumerate(clients):
        c["client"] = i
    return clients


def run_client(http: httpx.Client, url: str, c: dict) -> dict:
    """One client's request (on the soak's shared connection pool); returns what it saw."""
    body = c["body"]
    out = {"client": c["client"], "kind": c["kind"], "what": c.get("what", "")}
    t0 = time.perf_counter()
    if c["kind"] == "healthy":
        r = http.post(url + "/v1/completions", json=body | {"return_token_ids": True}, timeout=120)
        choice = r.json()["choices"][0]
        out |= {"status": r.status_code, "outcome": "finished", "finish_reason": choice["finish_reason"]}
        out["tokens"] = choice["token_ids"]
    elif c["kind"] in ("healthy-stream", "hang-up"):
        events, tokens = 0, []
        stream = body | {"stream": True, "return_token_ids": True}
        with http.stream("POST", url + "/v1/completions", json=stream, timeout=120) as r:
            out["status"] = r.status_code
            reason = None
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for ch in json.loads(line[6:])["choices"]:
                    tokens += ch.get("token_ids") or []
                    reason = ch.get("finish_reason") or reason
                events += 1
                if c["kind"] == "hang-up" and events == HANG_UP_AFTER:
                    break  # leaving the block closes the connection mid-stream
        hung_up = c["kind"] == "hang-up"
        out |= {
            "outcome": "aborted" if hung_up else "finished",
            "finish_reason": reason or "",
            "tokens": tokens,
        }
    else:
        kw = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, bytes)
            else {}
        )
        r = http.post(url + "/v1/completions", **(kw or {"json": body}), timeout=30)
        out |= {"status": r.status_code, "outcome": "refused", "finish_reason": "", "tokens": []}
        out["error"] = r.json()["error"]["message"] if r.status_code >= 400 else ""
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def ended_by_reason(url: str) -> dict[str, int]:
    """/metrics' count of requests that ended, by finish reason."""
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    return {
        s.labels["finish_reason"]: int(s.value)
        for s in fams["nanoserve_requests"].samples
        if s.name == "nanoserve_requests_total"
    }


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """/health once nothing runs or waits (or the timeout passes): the blocks should be back."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        idle = health["running"] == 0 and health["waiting"] == 0 and health["kv_blocks_used"] == 0
        if idle or time.monotonic() > deadline:
            return health
        time.sleep(0.02)


def check_nothing_lost(results: list[dict], ended: dict[str, int], health: dict, engine: Engine) -> None:
    """Raise AssertionError with a sentence if any request or block is unaccounted for."""
    seen = Counter(r["outcome"] for r in results)
    if ended.get("length", 0) != seen["finished"]:
        raise AssertionError(
            f"clients saw {seen['finished']} finish, the server counted {ended.get('length', 0)}"
        )
    if ended.get("abort", 0) != seen["aborted"]:
        raise AssertionError(
            f"clients hung up {seen['aborted']} times, the server aborted {ended.get('abort', 0)}"
        )
    if sum(ended.values()) != seen["finished"] + seen["aborted"]:
        raise AssertionError(f"the server counted {ended} ended requests; clients saw {dict(seen)}")
    if health["kv_blocks_used"] != 0 or health["running"] or health["waiting"]:
        raise AssertionError(
            f"after the soak /health says {health['kv_blocks_used']} KV blocks used, "
            f"{health['running']} running, {health['waiting']} waiting"
        )
    engine.allocator.check_invariants([])  # no request is live: no block may be held


def plant_leak(engine: Engine) -> None:
    """A scheduler whose abort takes the request off the running list but forgets its blocks."""
    sched = engine.scheduler
    real = sched.finish

    def leaky(seq, reason):
        if reason == "abort" and seq in sched.running:
            seq.finish_reason = reason
            sched.running.remove(seq)
            sched.on_leave(seq)
            return  # the planted bug: no allocator.free(seq.block_table)
        real(seq, reason)

    sched.finish = leaky


def clean_tokens(clients: list[dict]) -> dict[int, list[int]]:
    """The healthy prompts' greedy tokens on a fresh engine that serves nothing else: no server,
    no hang-ups, no bad bodies, all of them in one `generate` call."""
    engine = make_engine(tiny_llama(0))
    healthy = [c for c in clients if c["kind"].startswith("healthy")]
    params = SamplingParams(max_tokens=HEALTHY_TOKENS, temperature=0, ignore_eos=True)
    outs = engine.generate([c["body"]["prompt"] for c in healthy], params, use_tqdm=False)
    return {c["client"]: out.token_ids for c, out in zip(healthy, outs)}


def soak(
    n_clients: int = 24,
    rounds: int = 1,
    leak: bool = False,
    seed: int = 0,
    idle_timeout: float = 10.0,
    trace: list | None = None,
    ref: dict | None = None,
) -> dict:
    """Run the soak; returns the clients' results, the server's counts, /health, and the check's verdict."""
    torch.manual_seed(seed)
    engine = make_engine(tiny_llama(0))
    if leak:
        plant_leak(engine)
    clients = [
        c | {"client": r * n_clients + c["client"]}
        for r in range(rounds)
        for c in plan_clients(n_clients, seed + r)
    ]
    results: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=len(clients) + 4, max_keepalive_connections=0)
    with ServerThread(create_app(engine)) as url, httpx.Client(limits=limits) as http:

        def one(c):
            res = run_client(http, url, c)
            with lock:
                results.append(res)

        done = threading.Event()

        def watch():  # /health's KV blocks in use, every 50 ms, until the soak is over
            while not done.is_set():
                trace.append((time.perf_counter() - t0, httpx.get(url + "/health").json()["kv_blocks_used"]))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch) if trace is not None else None
        if watcher is not None:
            watcher.start()
        threads = [threading.Thread(target=one, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wall = time.perf_counter() - t0
        health = wait_idle(url, idle_timeout)
        done.set()
        if watcher is not None:
            watcher.join()
            # the idle reading last: the watcher's own last one may predate the idle state by 50 ms
            trace.append((time.perf_counter() - t0, health["kv_blocks_used"]))
        ended = ended_by_reason(url)
        results.sort(key=lambda r: r["client"])
        try:
            check_nothing_lost(results, ended, health, engine)
            verdict = "nothing lost"
        except AssertionError as e:
            verdict = f"caught: {e}"
    ref = ref if ref is not None else clean_tokens(clients)
    same = sum(r["tokens"] == ref[r["client"]] for r in results if r["kind"].startswith("healthy"))
    return {
        "results": results,
        "ended": ended,
        "health": health,
        "verdict": verdict,
        "same": same,
        "wall_s": wall,
        "num_blocks": engine.allocator.num_blocks,
        "engine": engine,
        "ref": ref,
    }


def summary_rows(run: dict) -> list[dict]:
    """One row per kind of client (and, for bad ones, what was wrong) and status code."""
    groups: dict[tuple, list[dict]] = {}
    for r in run["results"]:
        groups.setdefault((r["kind"], r["what"], r["status"], r["outcome"]), []).append(r)
    rows = []
    for (kind, what, status, outcome), rs in sorted(groups.items()):
        tokens = [len(r["tokens"]) for r in rs]
        rows.append(
            {
                "kind": kind,
                "what": what,
                "status": status,
                "outcome": outcome,
                "requests": len(rs),
                "tokens_each": min(tokens) if min(tokens) == max(tokens) else f"{min(tokens)}-{max(tokens)}",
                "p50_s": round(sorted(r["seconds"] for r in rs)[len(rs) // 2], 3),
            }
        )
    return rows


def ledger_row(name: str, run: dict) -> dict:
    """One run's books: what the clients saw, what the server counted, what /health said after."""
    seen = Counter(r["outcome"] for r in run["results"])
    return {
        "run": name,
        "clients": len(run["results"]),
        "finished": seen["finished"],
        "aborted": seen["aborted"],
        "refused": seen["refused"],
        "server_length": run["ended"].get("length", 0),
        "server_abort": run["ended"].get("abort", 0),
        "running_after": run["health"]["running"],
        "waiting_after": run["health"]["waiting"],
        "blocks_leaked": "yes" if run["health"]["kv_blocks_used"] else "no",
        "kv_blocks_after": run["health"]["kv_blocks_used"],
        "healthy_equal_clean": run["same"],
        "check": run["verdict"].split(":")[0],
        "wall_s": round(run["wall_s"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=48, help="clients per round, all at once")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args()
    torch.set_num_threads(1)
    clean = soak(args.clients, args.rounds)
    leak = soak(args.clients, args.rounds, leak=True, idle_timeout=2.0, ref=clean["ref"])
    rows = summary_rows(clean)
    for r in rows:
        print(r)
    ledger = [ledger_row("clean", clean), ledger_row("planted leak", leak)]
    for r in ledger:
        print(r)
    print("clean:", clean["verdict"], "| leak:", leak["verdict"])
    cpu = {"cpu": cpu_line()}  # the machine the timings were taken on
    write_csv([r | cpu for r in rows], args.out / "day-46-soak.csv")
    write_csv([r | cpu for r in ledger], args.out / "day-46-ledger.csv")
    cols = ("client", "kind", "what", "status", "outcome", "finish_reason", "seconds")
    write_csv(
        [{k: r[k] for k in cols} | {"tokens": len(r["tokens"])} | cpu for r in clean["results"]],
        args.out / "day-46-clients.csv",
    )


if __name__ == "__main__":
    main()
