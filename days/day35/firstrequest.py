"""Day 35: the engine behind HTTP, asked its first questions on loopback.

`create_app(engine)` is served by uvicorn on a free port of 127.0.0.1, in a thread of this
process (`nanocourse.ServerThread`), and a fixed list of requests goes to it through real HTTP
clients: httpx, and the official `openai` package for the completions. The engine is the tiny
random-weight Llama with no tokenizer, so prompts are token ids and the tokens come back through
`return_token_ids`. Before the server starts, the same engine runs the prompt itself
(`Engine.generate`, greedy); every completion is compared with those tokens.

Per request (`day-35-requests.csv`): which client, the method and path, what it asked, the
status code, the error type and code when there is one, the tokens that came back, whether they
equal the engine's own, and this run's time for the round trip.

    python days/day35/firstrequest.py                 # writes day-35-requests.csv next to this file
    python days/day35/firstrequest.py --max-tokens 32
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import openai
import torch

from nanocourse import ServerThread, engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.sampling import SamplingParams
from nanoserve.serve import create_app

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-35-requests.csv"
MODEL = "tiny-llama"
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def make_engine(model, rows: int = 4, blocks: int = 64) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    budget = blocks * per_block + per_block // 16  # + the sink slot
    config = engine_config(35, max_batch=rows, max_model_len=256, kv_budget=budget)
    engine = Engine(model, None, config)
    engine.model_name = MODEL  # what /v1/models lists and requests must name
    return engine


def engine_tokens(engine: Engine, prompt=PROMPT, max_tokens: int = 8) -> list[int]:
    """The engine's own greedy answer, run before the server owns the engine."""
    (done,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return done.token_ids


def requests_table(url: str, own: list[int], prompt=PROMPT, max_tokens: int = 8) -> list[dict]:
    """Send the day's requests to the server at `url`; one row each."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}
    rows = []

    def row(client, method, path, asked, status, tokens=None, error=None, ms=0.0):
        err = error or {}
        rows.append(
            {
                "client": client,
                "method": method,
                "path": path,
                "asked": asked,
                "status": status,
                "error_type": err.get("type", ""),
                "error_code": err.get("code", "") if err.get("code") is not None else "",
                "tokens": len(tokens) if tokens is not None else "",
                "same_as_engine": ("yes" if tokens == own else "no") if tokens is not None else "",
                "ms": round(ms, 1),
            }
        )

    def http(method, path, asked, json=None):
        t0 = time.perf_counter()
        r = httpx.request(method, url + path, json=json, timeout=30)
        ms = 1000 * (time.perf_counter() - t0)
        data = r.json()
        tokens = data["choices"][0].get("token_ids") if r.status_code == 200 and "choices" in data else None
        row("httpx", method, path, asked, r.status_code, tokens, data.get("error"), ms)
        return r

    http("GET", "/health", "")
    http("GET", "/v1/models", "")
    http("POST", "/v1/completions", "greedy", body | {"temperature": 0})
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    for asked, extra in (("greedy", {"temperature": 0}), ("temperature left out, seed 0", {"seed": 0})):
        t0 = time.perf_counter()
        reply = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body={"return_token_ids": True}, **extra
        )
        ms = 1000 * (time.perf_counter() - t0)
        row("openai", "POST", "/v1/completions", asked, 200, reply.choices[0].token_ids, None, ms)
    http("POST", "/v1/completions", "model gpt-4", body | {"model": "gpt-4"})
    http("GET", "/v1/nothing-here", "")
    http("GET", "/v1/completions", "")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--out", default=str(CSV))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    engine = make_engine(tiny_llama(0))
    own = engine_tokens(engine, max_tokens=args.max_tokens)
    print("the engine's own tokens:", own)
    with ServerThread(create_app(engine)) as url:
        rows = requests_table(url, own, max_tokens=args.max_tokens)
    rows = [r | {"cpu": cpu_line()} for r in rows]  # the ms column is this machine's
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
