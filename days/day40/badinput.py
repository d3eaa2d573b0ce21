"""Day 40: bad requests, the answers they get, and the requests in flight beside them.

One in-process server (uvicorn on loopback, `nanocourse.ServerThread`) serves the course's tiny
random-weight Llama widened to SmolLM2's vocabulary, so SmolLM2's tokenizer and chat template
work on it, with a context of 256 tokens and a body cap of 64 KiB. Two healthy streaming
completions are put in flight first; then the engine is held (a gate on `Engine.step`) and
every bad request of `CASES` is sent through httpx, so none of them can be answered by a step;
then a request that passes validation but used to poison a step (temperature 1e-39) joins the
healthy two. The healthy ones must finish with the tokens the engine gives them alone.

Per bad request (`day-40-bad-input.csv`): what is wrong with it, the route, the status it
should get and the one it got, and OpenAI's error object (type, param, code, message).
`day-40-planted.csv`: the same requests against a planted server whose `check_supported` lets
everything through: the rows whose status changed.

    python days/day40/badinput.py                 # writes both CSVs next to this file
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import threading
import time
from pathlib import Path

import httpx
import torch

from nanocourse import ServerThread, engine_config, tiny_config, write_csv
from nanoserve.engine import Engine
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams
from nanoserve.serve import create_app

HERE = Path(__file__).resolve().parent
MODEL = "tiny-smol"
CONTEXT = 256
BODY_CAP = 64 * 2**10
HEALTHY = ("The lighthouse keeper", "Once upon a time")
HI = {"role": "user", "content": "hi"}
C, CHAT = "/v1/completions", "/v1/chat/completions"

# (what is wrong, method, route, body (bytes are sent as they are), the status it should get, and
# where the server refuses it: JSON parsing, the pydantic schema, the server's limits, the context
# check, the prompt's own checks, check_supported, the model name, routing, or the body cap)
CASES = [
    ("body is not JSON", "POST", C, b"{not json", 400, "JSON"),
    ("body is a JSON list", "POST", C, b"[1, 2]", 400, "schema"),
    ("prompt missing", "POST", C, {"max_tokens": 4}, 400, "schema"),
    ("prompt is a number", "POST", C, {"prompt": 5}, 400, "schema"),
    ("max_tokens is a string", "POST", C, {"prompt": "hi", "max_tokens": "5"}, 400, "schema"),
    ("n is a string", "POST", C, {"prompt": "hi", "n": "2"}, 400, "schema"),
    ("echo is a string", "POST", C, {"prompt": "hi", "echo": "yes"}, 400, "schema"),
    ("temperature below 0", "POST", C, {"prompt": "hi", "temperature": -1}, 400, "schema"),
    ("temperature above 2", "POST", C, {"prompt": "hi", "temperature": 3}, 400, "schema"),
    ("top_p of 0", "POST", C, {"prompt": "hi", "top_p": 0}, 400, "schema"),
    ("n above 16", "POST", C, {"prompt": "hi", "n": 17}, 400, "schema"),
    ("logprobs above 20", "POST", C, {"prompt": "hi", "logprobs": 21}, 400, "schema"),
    ("seed below 0", "POST", C, {"prompt": "hi", "seed": -1}, 400, "schema"),
    ("five stop strings", "POST", C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "limits"),
    ("max_tokens of 0", "POST", C, {"prompt": "hi", "max_tokens": 0}, 400, "limits"),
    ("min_p above 1", "POST", C, {"prompt": "hi", "min_p": 2}, 400, "limits"),
    ("max_tokens past the context", "POST", C, {"prompt": "hi", "max_tokens": 500}, 400, "context"),
    (
        "prompt longer than the context",
        "POST",
        C,
        {"prompt": "hello " * 300, "max_tokens": 4},
        400,
        "context",
    ),
    ("prompt too long in characters", "POST", C, {"prompt": "a" * 50_000, "max_tokens": 4}, 400, "context"),
    ("empty prompt", "POST", C, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "POST", C, {"prompt": []}, 400, "prompt"),
    ("an empty prompt in the list", "POST", C, {"prompt": ["hi", ""]}, 400, "prompt"),
    ("token id outside the vocabulary", "POST", C, {"prompt": [5, 999999]}, 400, "prompt"),
    ("a lone surrogate in the text", "POST", C, b'{"prompt": "hi \\ud800 there"}', 400, "prompt"),
    (
        "typical_p (would change the answer)",
        "POST",
        C,
        {"prompt": "hi", "typical_p": 0.9},
        400,
        "unsupported",
    ),
    ("mirostat", "POST", C, {"prompt": "hi", "mirostat": 2}, 400, "unsupported"),
    ("use_beam_search", "POST", C, {"prompt": "hi", "use_beam_search": True}, 400, "unsupported"),
    ("length_penalty", "POST", C, {"prompt": "hi", "length_penalty": 0.8}, 400, "unsupported"),
    ("suffix", "POST", C, {"prompt": "hi", "suffix": " the end"}, 400, "unsupported"),
    (
        "an unknown field that changes nothing",
        "POST",
        C,
        {"prompt": "hi", "max_tokens": 2, "user": "u1"},
        200,
        "accepted",
    ),
    ("no messages", "POST", CHAT, {"messages": []}, 400, "schema"),
    ("messages is a string", "POST", CHAT, {"messages": "hi"}, 400, "schema"),
    (
        "a role that does not exist",
        "POST",
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "schema",
    ),
    (
        "functions (the older tool calls)",
        "POST",
        CHAT,
        {"messages": [HI], "max_tokens": 4, "functions": [{"name": "f"}]},
        400,
        "unsupported",
    ),
    (
        "structured_outputs (vLLM's newer field)",
        "POST",
        CHAT,
        {"messages": [HI], "max_tokens": 4, "structured_outputs": {"json": {"type": "object"}}},
        400,
        "unsupported",
    ),
    (
        "top_logprobs without logprobs",
        "POST",
        CHAT,
        {"messages": [HI], "max_tokens": 4, "top_logprobs": 3},
        400,
        "unsupported",
    ),
    ("a model this server does not serve", "POST", C, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("a route that does not exist", "GET", "/v1/nothing-here", None, 404, "routing"),
    ("the wrong method", "GET", C, None, 405, "routing"),
    ("a body over the cap", "POST", C, {"prompt": "a" * (BODY_CAP + 1)}, 413, "body cap"),
]


# --- the engine and the server --------------------------------------------------------------------


def tiny_model(vocab_size: int, seed: int = 0) -> Llama:
    """The course's tiny Llama (2 layers, hidden 64) with a vocabulary as wide as the tokenizer's."""
    torch.manual_seed(seed)
    model = Llama(dataclasses.replace(tiny_config(512), vocab_size=vocab_size))
    for p in model.parameters():
        p.normal_(0, 0.05)
    return model.eval()


def make_engine(model, tokenizer, rows: int = 4, blocks: int = 48) -> Engine:
    per_token = model.cfg.kv_bytes_per_token(model.dtype)
    budget = blocks * 16 * per_token + per_token  # the blocks and the sink slot
    config = engine_config(40, max_batch=rows, max_model_len=CONTEXT, kv_budget=budget)
    engine = Engine(model, tokenizer, config)
    engine.model_name = MODEL
    return engine


def alone(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    """The greedy tokens of `prompts` run by the engine itself, with nothing else in the batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(list(prompts), params, use_tqdm=False)]


class Gate:
    """Wraps `engine.step`: while closed, the engine loop waits before its next step."""

    def __init__(self, engine: Engine):
        self.engine, self.real, self.open = engine, engine.step, threading.Event()
        self.open.set()
        self.steps = 0
        engine.step = self.step

    def step(self):
        self.open.wait()
        self.steps += 1
        return self.real()

    def close(self) -> None:
        self.engine.step = self.real


@contextlib.contextmanager
def planted_check_supported():
    """A server that parses every field and implements none of the unsupported ones: it lets
    them through instead of refusing them (nanoserve.serve looks the check up at call time)."""
    import nanoserve.serve as serve

    real = serve.check_supported
    serve.check_supported = lambda req: None
    try:
        yield
    finally:
        serve.check_supported = real


# --- the requests ---------------------------------------------------------------------------------


def send(url: str, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        return httpx.request(method, url + path, content=body, headers=headers, timeout=30)
    return httpx.request(method, url + path, json=body, timeout=30)


def bad_table(url: str, cases=CASES) -> list[dict]:
    """Every case sent once; one row each with the status and the error object."""
    rows = []
    for what, method, path, body, expected, where in cases:
        r = send(url, method, path, body)
        err = (
            r.json().get("error") or {}
            if r.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        rows.append(
            {
                "case": what,
                "route": f"{method} {path}",
                "refused_by": where,
                "expected": expected,
                "status": r.status_code,
                "type": err.get("type") or "",
                "param": err.get("param") or "",
                "code": err.get("code") if err.get("code") is not None else "",
                "message": err.get("message", ""),
                "traceback": "yes" if "Traceback" in r.text else "no",
            }
        )
    return rows


def check_statuses(rows: list[dict]) -> None:
    """Every request got the status it should, with a sentence and no traceback."""
    wrong = [
        f"{r['case']}: {r['status']} (should be {r['expected']})"
        for r in rows
        if r["status"] != r["expected"]
    ]
    if wrong:
        raise AssertionError(f"{len(wrong)} requests got the wrong status: " + "; ".join(wrong))
    for r in rows:
        bad = r["expected"] >= 400
        if bad and (len(r["message"]) < 10 or r["traceback"] == "yes" or not r["type"]):
            raise AssertionError(f"{r['case']}: the error object is not a sentence: {r}")


class Stream(threading.Thread):
    """One healthy streaming completion, greedy, reading every token id it is sent."""

    def __init__(self, url: str, prompt: str, max_tokens: int, temperature: float = 0.0):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens, self.temperature = url, prompt, max_tokens, temperature
        self.token_ids: list[int] = []
        self.finish = None
        self.status = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        with httpx.stream("POST", self.url + C, json=body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        self.token_ids += c.get("token_ids") or []
                        self.finish = c["finish_reason"] or self.finish


def poisoned_run(engine: Engine, max_tokens: int = 32) -> dict:
    """Two healthy streams in flight, every bad request while the engine is held, then a
    temperature of 1e-39 beside the two. What each got, and what the engine did meanwhile."""
    gate = Gate(engine)
    app = create_app(engine, max_body_bytes=BODY_CAP)
    try:
        with ServerThread(app) as url:
            healthy = [Stream(url, p, max_tokens) for p in HEALTHY]
            for s in healthy:
                s.start()
            deadline = time.monotonic() + 30
            while min(len(s.token_ids) for s in healthy) < 4 and time.monotonic() < deadline:
                time.sleep(0.002)
            gate.open.clear()  # the engine stops before its next step
            time.sleep(0.05)
            steps, used = gate.steps, engine.allocator.num_used
            refused = [c for c in CASES if c[4] >= 400]  # answered without the engine
            rows = bad_table(url, refused)
            during = {
                "steps": gate.steps - steps,
                "blocks_before": used,
                "blocks_after": engine.allocator.num_used,
            }
            tiny = Stream(url, HEALTHY[0], max_tokens, temperature=1e-39)
            tiny.start()
            time.sleep(0.05)
            gate.open.set()
            taken = bad_table(url, [c for c in CASES if c[4] < 400])  # these need a step
            rows = [next(r for r in rows + taken if r["case"] == c[0]) for c in CASES]
            for s in (*healthy, tiny):
                s.join(60)
            deadline = time.monotonic() + 10
            while engine.has_unfinished() and time.monotonic() < deadline:
                time.sleep(0.01)
            health = httpx.get(url + "/health").json()
    finally:
        gate.open.set()
        gate.close()
    return {"rows": rows, "healthy": healthy, "tiny": tiny, "during": during, "health": health}


def planted_table(engine: Engine) -> list[dict]:
    """Every case against a server whose check_supported is planted (no healthy streams, no gate:
    a field it lets through is computed like any request)."""
    with planted_check_supported(), ServerThread(create_app(engine, max_body_bytes=BODY_CAP)) as url:
        return bad_table(url)


def planted_rows(good: list[dict], planted: list[dict]) -> list[dict]:
    """The cases whose status the planted server changed."""
    return [
        {"case": g["case"], "expected": g["expected"], "status": g["status"], "planted_status": p["status"]}
        for g, p in zip(good, planted)
        if g["status"] != p["status"]
    ]


def main(argv=None) -> None:
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each healthy stream asks for")
    p.add_argument("--out-dir", default=str(HERE))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tok = Tokenizer.from_dir(fetch_default_model())
    model = tiny_model(tok.vocab_size)
    reference = alone(make_engine(model, tok), HEALTHY, args.max_tokens)
    run = poisoned_run(make_engine(model, tok), args.max_tokens)
    check_statuses(run["rows"])
    assert [s.token_ids for s in run["healthy"]] == reference, "a healthy stream's tokens changed"
    planted = planted_table(make_engine(model, tok))
    out = Path(args.out_dir)
    for r in run["rows"]:
        print(f"{r['status']} {r['case']}: {r['message']}")
    print("while the bad requests were answered:", run["during"])
    print(f"wrote {write_csv(run['rows'], out / 'day-40-bad-input.csv')}")
    print(f"wrote {write_csv(planted_rows(run['rows'], planted), out / 'day-40-planted.csv')}")


if __name__ == "__main__":
    main()
