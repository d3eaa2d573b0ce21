"""Day 39: clients that leave, and what the server does with their blocks.

Three clients ask one in-process server (uvicorn on loopback, `nanocourse.ServerThread`) for
greedy completions at once; one of them, the leaver, goes away before its answer is complete.
The engine is the course's tiny random-weight Llama with SmolLM2's vocabulary, so the real
tokenizer turns its tokens into text and the streams carry characters. A `Pacer` wraps
`Engine.step` so the engine loop takes a step only when told to: the leaver leaves at a known
step, and every count below is the same on every run.

Two servers: the package's, whose handlers call `EngineLoop.abort` when the client is gone
(`responses.py` notices the disconnect), and a planted one whose abort is dropped (the handler
still notices; the engine never hears of it). Two leavers: a stream that closes after 8 tokens,
and a non-streaming client that gives up while its request is still queued.

Per run (`day-39-disconnects.csv`): which server and leaver, the step it left at, the tokens it
had, its blocks then, the tokens computed for it after it left, the steps until its blocks were
free, its block-steps held after leaving, the blocks in use once the other two had finished, and
whether their tokens equal a run without the leaver. `notice_ms` (this run's clock) is the time
from the client's close to the server's abort call.

    python days/day39/disconnects.py                  # writes day-39-disconnects.csv here
    python days/day39/disconnects.py --leave-after 20 --max-tokens 400
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
import torch

from nanocourse import ServerThread, engine_config, tiny_config, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams
from nanoserve.serve import create_app

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-39-disconnects.csv"
MODEL = "tiny-smol"
STAY = ("The lighthouse keeper", "Once upon a time")  # the two clients that stay to the end
LEAVER = "Count slowly to a hundred:"


# --- the engine -----------------------------------------------------------------------------------


def tiny_model(vocab_size: int, seed: int = 0) -> Llama:
    """The course's tiny Llama (2 layers, hidden 64) with a vocabulary as wide as the tokenizer's."""
    torch.manual_seed(seed)
    model = Llama(dataclasses.replace(tiny_config(512), vocab_size=vocab_size))
    for p in model.parameters():
        p.normal_(0, 0.05)
    return model.eval()


def make_engine(model, tokenizer, rows: int = 4, blocks: int = 32, max_model_len: int = 256) -> Engine:
    per_token = model.cfg.kv_bytes_per_token(model.dtype)
    budget = blocks * 16 * per_token + per_token  # the blocks and the sink slot
    config = engine_config(39, max_batch=rows, max_model_len=max_model_len, kv_budget=budget)
    engine = Engine(model, tokenizer, config)
    engine.model_name = MODEL
    return engine


def alone(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    """The greedy tokens of `prompts` run by the engine itself, with no leaver beside them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(list(prompts), params, use_tqdm=False)]


# --- steps on demand ------------------------------------------------------------------------------


class Pacer:
    """Wraps `engine.step` so the engine loop steps only when `run(n)` allows it. The loop calls
    `step` after draining its inbox, so an abort that arrives while a step waits here is handled
    right after that step. `trace` holds, after each step, the blocks in use and each request's."""

    def __init__(self, engine: Engine, labels: dict[tuple, str]):
        self.engine, self.labels = engine, labels  # labels: prompt token ids -> a name
        self.real = engine.step
        self.cv = threading.Condition()
        self.allowed = self.done = 0
        self.waiting = False
        self.trace: list[dict] = []
        self.made: dict[str, int] = {}  # tokens each request has been given, by name
        engine.step = self.step

    def close(self) -> None:
        self.engine.step = self.real

    def step(self):
        with self.cv:
            self.waiting = True
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.allowed > 0)
            self.allowed -= 1
            self.waiting = False
        names = {rid: self.name(req) for rid, req in self.engine.requests.items()}
        outs = self.real()
        with self.cv:
            self.done += 1
            for out in outs:
                name = names.get(out.request_id, "?")
                self.made[name] = self.made.get(name, 0) + len(out.new_token_ids)
            self.trace.append(self.snapshot())
            self.cv.notify_all()
        return outs

    def name(self, req) -> str:
        return self.labels.get(tuple(req.seq.prompt_ids), "?")

    def snapshot(self) -> dict:
        """After a step: blocks in use, each request's blocks, and the tokens each has made."""
        held = {self.name(req): len(req.seq.block_table.blocks) for req in self.engine.requests.values()}
        return {
            "step": self.done,
            "used": self.engine.allocator.num_used,
            "held": held,
            "made": dict(self.made),
        }

    def settled(self) -> bool:
        """The loop is waiting for the next step, or has nothing to step."""
        return self.waiting or not self.engine.has_unfinished()

    def run(self, n: int = 1, timeout: float = 30.0) -> None:
        """Allow n more steps; return once they are done and the loop is waiting again."""
        with self.cv:
            target = self.done + n
            self.allowed += n
            self.cv.notify_all()
        deadline = time.monotonic() + timeout
        with self.cv:
            while not (self.done >= target and self.settled()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine took {self.done} steps, not {target}")
                self.cv.wait(0.01)  # woken when a step starts waiting; polls only for an idle loop

    def release(self) -> None:
        """No more pacing: the loop steps freely."""
        with self.cv:
            self.allowed = 10**9
            self.cv.notify_all()

    def wait_gate(self, timeout: float = 30.0) -> None:
        wait_for(lambda: self.waiting, timeout, "the engine loop never reached its next step")


def wait_for(cond, timeout: float = 30.0, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


# --- the clients ----------------------------------------------------------------------------------


class Client(threading.Thread):
    """One completion request over real HTTP. Streaming, it reads the events, keeps the token ids,
    and closes the connection once it has `leave_after` tokens; not streaming, it gives up after
    `timeout` seconds (httpx raises ReadTimeout and closes the connection)."""

    def __init__(self, url: str, prompt: str, max_tokens: int, stream=True, leave_after=None, timeout=60.0):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.stream, self.leave_after, self.timeout = stream, leave_after, timeout
        self.token_ids: list[int] = []
        self.text = ""
        self.finish: str | None = None
        self.left_at: float | None = None  # perf_counter when it closed, if it left

    def body(self) -> dict:
        return {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": self.stream,
        }

    def run(self) -> None:
        if not self.stream:
            try:
                r = httpx.post(self.url + "/v1/completions", json=self.body(), timeout=self.timeout)
                choice = r.json()["choices"][0]
                self.token_ids, self.text, self.finish = (
                    choice["token_ids"],
                    choice["text"],
                    choice["finish_reason"],
                )
            except httpx.ReadTimeout:
                self.left_at = time.perf_counter()
            return
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body(), timeout=self.timeout) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:])["choices"]:
                    self.token_ids += c.get("token_ids") or []
                    self.text += c["text"]
                    self.finish = c["finish_reason"] or self.finish
                if self.leave_after is not None and len(self.token_ids) >= self.leave_after:
                    self.left_at = time.perf_counter()
                    break  # leaving the block closes the connection


# --- one run --------------------------------------------------------------------------------------


def generated(engine: Engine, prompt_ids: list[int]) -> int | None:
    """Tokens the engine has made so far for the request with this prompt (None: not in it)."""
    for req in engine.requests.values():
        if req.seq.prompt_ids == prompt_ids:
            return len(req.seq.output_ids)
    return None


def health(url: str) -> dict:
    h = httpx.get(url + "/health").json()
    return {k: h[k] for k in ("running", "waiting", "kv_blocks_used")}


def run_server(engine, tok, aborts=True, streaming=True, leave_after=8, max_tokens=32, leaver_tokens=200):
    """Two clients that stay and one that leaves, against one server; the engine paced step by
    step. Returns what each client got, /health at five moments, the abort calls and the trace."""
    ids = {p: tok.encode(p) for p in (*STAY, LEAVER)}
    labels = {tuple(ids[STAY[0]]): "A", tuple(ids[STAY[1]]): "B", tuple(ids[LEAVER]): "C"}
    pacer = Pacer(engine, labels)
    app = create_app(engine)
    seen = {}  # /health at the moments the notebook prints
    calls: list[tuple[str, float]] = []  # (request id, perf_counter) of each abort the handlers asked for
    try:
        with ServerThread(app) as url:
            loop = app.state.nanoserve.loop
            real_abort = loop.abort

            def abort(rid: str) -> None:
                now = time.perf_counter()
                if aborts:
                    real_abort(rid)  # the planted server drops it: the engine never hears
                calls.append((rid, now))  # after the abort is in the inbox, so a step can follow

            loop.abort = abort
            seen["before"] = health(url)
            a = Client(url, STAY[0], max_tokens)
            a.start()
            pacer.wait_gate()  # A is in the engine; the loop waits for its first step
            b = Client(url, STAY[1], max_tokens)
            c = Client(url, LEAVER, leaver_tokens, streaming, leave_after, timeout=60.0 if streaming else 0.5)
            b.start()
            wait_for(lambda: loop.inbox.qsize() == 1, what="B in the inbox")
            c.start()
            wait_for(lambda: loop.inbox.qsize() == 2, what="C in the inbox")
            if streaming:  # step until the leaver has what it came for and closes
                while c.left_at is None:
                    pacer.run(1)
                    made = pacer.made.get("C", 0)
                    wait_for(
                        lambda made=made: c.left_at is not None or len(c.token_ids) >= made, what="C's tokens"
                    )
                wait_for(lambda: len(calls) > 0, what="the server to notice")
            else:  # A alone, then B joins; C, accepted, waits for a row; it gives up there
                pacer.run(2)
                wait_for(lambda: c.left_at is not None, what="C to give up")
                wait_for(lambda: len(calls) > 0, what="the server to notice")
            left_step = pacer.done
            seen["at the leave"] = health(url)
            c_tokens_then = pacer.made.get("C", 0)
            c_blocks_then = pacer.snapshot()["held"].get("C", 0)
            pacer.run(1)
            seen["one step later"] = health(url)
            pacer.run(max(max_tokens - pacer.made.get(n, 0) for n in "AB"))  # B joined a step after A
            seen["A and B done"] = health(url)
            ab_done_step = pacer.done
            a.join(30)
            b.join(30)
            c_after = generated(engine, ids[LEAVER])
            pacer.release()  # let whatever is left run out
            wait_for(lambda: not engine.has_unfinished(), what="the engine to finish")
            seen["after"] = health(url)
    finally:
        pacer.close()
    return {
        "a": a,
        "b": b,
        "c": c,
        "health": seen,
        "calls": calls,
        "trace": pacer.trace,
        "left_step": left_step,
        "ab_done_step": ab_done_step,
        "c_tokens_then": c_tokens_then,
        "c_blocks_then": c_blocks_then,
        "c_still_running": c_after is not None,
    }


def check_freed(trace: list[dict], left_step: int, within: int = 1, name: str = "C") -> None:
    """The leaver's request is out of the engine within `within` steps of the step it left at
    (one step may already be waiting to run with it when the abort arrives)."""
    late = [t for t in trace if t["step"] > left_step + within and name in t["held"]]
    if late:
        t = late[-1]
        raise AssertionError(
            f"{name} left after step {left_step}, and after step {t['step']} the engine still held it, "
            f"with {t['held'][name]} blocks ({len(late)} steps past the {within} allowed)"
        )


def summarize(run: dict, server: str, leaver: str, reference: list[list[int]]) -> dict:
    """One row of the table from one run."""
    left = run["left_step"]
    after = [t for t in run["trace"] if t["step"] > left and "C" in t["held"]]
    c = run["c"]
    # the streaming client notes its close before it closes; httpx notes a timeout after it has closed
    notice = round(1000 * (run["calls"][0][1] - c.left_at), 1) if c.stream else ""
    return {
        "server": server,
        "leaver": leaver,
        "left_after_step": left,
        "tokens_when_left": len(c.token_ids),
        "blocks_when_left": run["c_blocks_then"],
        "steps_after_leaving": len(after),
        "tokens_after_leaving": run["trace"][-1]["made"].get("C", 0) - run["c_tokens_then"],
        "block_steps_after_leaving": sum(t["held"]["C"] for t in after),
        "blocks_used_when_others_done": run["health"]["A and B done"]["kv_blocks_used"],
        "others_equal_alone": "yes" if [run["a"].token_ids, run["b"].token_ids] == reference else "no",
        "notice_ms": notice,
    }


SERVERS = (("aborts", True), ("never aborts (planted)", False))
LEAVERS = (("stream, leaves after {n} tokens", True), ("non-streaming, gives up queued", False))


def one_run(model, tok, aborts: bool, streaming: bool, leave_after=8, max_tokens=32, leaver_tokens=200):
    engine = make_engine(model, tok, rows=4 if streaming else 2)  # 2 rows: C queues behind A and B
    return run_server(engine, tok, aborts, streaming, leave_after, max_tokens, leaver_tokens)


def table(model, tok, leave_after=8, max_tokens=32, leaver_tokens=200, runs=None, reference=None):
    """The four runs (each server, each leaver); `runs` may hold some already made, keyed
    (aborts, streaming), and `reference` the tokens `alone`. Returns the rows and the runs."""
    reference = reference or alone(make_engine(model, tok), STAY, max_tokens)
    runs = dict(runs or {})
    rows = []
    for server, aborts in SERVERS:
        for leaver, streaming in LEAVERS:
            if (aborts, streaming) not in runs:
                runs[aborts, streaming] = one_run(
                    model, tok, aborts, streaming, leave_after, max_tokens, leaver_tokens
                )
            rows.append(summarize(runs[aborts, streaming], server, leaver.format(n=leave_after), reference))
    return rows, runs


def main(argv=None) -> None:
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leave-after", type=int, default=8, help="tokens the streaming leaver reads")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens the two staying clients ask for")
    p.add_argument("--leaver-tokens", type=int, default=200, help="tokens the leaver asks for")
    p.add_argument("--out", default=str(CSV))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(fetch_default_model())
    rows, _ = table(tiny_model(tok.vocab_size), tok, args.leave_after, args.max_tokens, args.leaver_tokens)
    rows = [r | {"cpu": cpu_line()} for r in rows]  # notice_ms is this machine's
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
