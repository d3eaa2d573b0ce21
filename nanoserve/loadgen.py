"""A load generator for the server (day 43): streaming clients over a fixed list of requests, and
what a client sees: time to first token (TTFT), inter-token latency (ITL), time per output token
(TPOT), throughput, and how many requests did not come back whole.

Two ways to send them. A closed loop (`run_load`): N clients, each sending its next request when
its last answer is done, so a slow server slows the clients down with it. An open loop
(`run_open_loop`): requests arrive as a Poisson process at a given rate (`poisson_arrivals`:
exponential gaps from a seeded RNG, as vLLM's benchmark does with `--request-rate`), whether or
not the server keeps up, so a server slower than the arrivals builds a queue and TTFT grows.
`goodput` counts the requests per second that met a latency objective (DistServe's goodput;
vLLM's `--goodput ttft:X tpot:Y`).

    reqs = chat_workload(64, max_tokens=32)
    report = asyncio.run(run_load("http://127.0.0.1:8000", reqs, concurrency=16))
    print(summarize(report))
    report = asyncio.run(run_open_loop("http://127.0.0.1:8000", reqs, rate=4.0, seed=0))
    print(summarize(report), goodput(report, ttft_ms=500, tpot_ms=50))

Every request streams `/v1/chat/completions` with `ignore_eos` (so it must return exactly
`max_tokens` tokens), `stream_options.include_usage` (the server's own count) and
`return_token_ids` (tokens per chunk: a chunk can carry more than one token when a character
spans tokens). A request is incomplete if it errs, is cut short, or its usage disagrees with
what it asked for; a healthy run has none.

Timings are taken on the client as chunks arrive: TTFT is the first chunk carrying a token,
each later chunk's gap is one ITL sample per token it carries, and TPOT is
(e2e - TTFT) / (tokens - 1), e2e being when the stream ended (after its finish and usage
chunks), so TTFT + (tokens - 1) x TPOT = e2e.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

QUESTIONS = [
    "What is a KV cache?",
    "Name three planets and one fact about each.",
    "Explain continuous batching to a new engineer.",
    "Write a haiku about paged memory.",
    "Why do GPUs like large batches?",
    "Give me a recipe for a quick breakfast.",
    "What is the capital of France, and why is it famous?",
    "Summarize the plot of a heist movie in three sentences.",
    "How does a hash table handle collisions?",
    "List five tips for writing clear documentation.",
    "What does an operating system scheduler do?",
    "Describe the water cycle.",
]


@dataclass
class LoadRequest:
    messages: list[dict] | None
    max_tokens: int
    prompt: list[int] | None = None  # token ids: sent to /v1/completions instead of chat
    # False: the model's end token ends the answer (complete then means "stop" or "length")
    ignore_eos: bool = True


@dataclass
class RequestResult:
    asked: int
    may_stop: bool = False  # the request let the end token finish it early
    tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    finish_reason: str | None = None
    usage_tokens: int | None = None
    error: str | None = None
    sent_at: float | None = None  # open loop: seconds from the run's start to this request's send

    @property
    def output_tokens(self) -> int:
        """The server's own count when it sent one (usage), else the tokens counted in chunks."""
        return self.usage_tokens if self.usage_tokens is not None else self.tokens

    @property
    def complete(self) -> bool:
        if self.may_stop and self.error is None and self.finish_reason == "stop":
            return 0 < self.output_tokens <= self.asked
        return self.error is None and self.finish_reason == "length" and self.output_tokens == self.asked

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class LoadReport:
    results: list[RequestResult]
    seconds: float
    concurrency: int  # closed loop: the clients; open loop: the most requests in flight at once
    rate: float | None = None  # open loop: the arrival rate asked for, requests/s (None: closed)


def chat_workload(n: int, max_tokens: int = 32, seed: int = 0, vary: bool = False) -> list[LoadRequest]:
    """n chat requests cycling through QUESTIONS; with vary, max_tokens is drawn from
    [max_tokens // 2, max_tokens] (seeded)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        m = rng.randint(max(1, max_tokens // 2), max_tokens) if vary else max_tokens
        out.append(LoadRequest([{"role": "user", "content": q}], m))
    return out


def _identifier_to_rename(code: str) -> str:
    """The longest identifier used at least three times in `code` (ties: the first seen)."""
    import re

    words = re.findall(r"\b[a-z_][a-z0-9_]{5,}\b", code)
    counts = {w: words.count(w) for w in dict.fromkeys(words)}
    keep = [w for w, c in counts.items() if c >= 3 and not w.startswith("__")]
    return max(keep, key=len)


def copy_workload(kind: str, n: int, max_tokens: int, lines: int = 200) -> list[LoadRequest]:
    """n chat requests whose answers copy long spans of their prompt (speculative decoding's
    best case, `bench speculative`), greedy, each ending at the model's end token or max_tokens:

    - "edit": `lines` lines of nanoserve's own source (a different stretch each request), to be
      written out again in full with one identifier renamed;
    - "summary": a journal entry's first `lines` // 2 lines, to be summarized quoting its key
      sentences word for word.
    """
    from pathlib import Path

    root = Path(__file__).resolve().parent
    out = []
    if kind == "edit":
        files = sorted(f for f in root.glob("*.py") if len(f.read_text().splitlines()) >= lines + 40)
        for i in range(n):
            text = files[i % len(files)].read_text().splitlines()
            start = 40 + (i // len(files)) * lines
            code = "\n".join(text[start : start + lines])
            old = _identifier_to_rename(code)
            ask = (
                f"Here is some Python code:\n\n```python\n{code}\n```\n\nRewrite it in full with one "
                f"change: rename `{old}` to `{old}_v2` everywhere. Reply with the code only."
            )
            out.append(LoadRequest([{"role": "user", "content": ask}], max_tokens, ignore_eos=False))
    elif kind == "summary":
        entries = sorted((root.parent / "journal").glob("day-*.md"))
        for i in range(n):
            passage = "\n".join(entries[(7 * i + 3) % len(entries)].read_text().splitlines()[: lines // 2])
            ask = (
                "Summarize the following passage in a few paragraphs, quoting its key sentences "
                f"word for word:\n\n{passage}"
            )
            out.append(LoadRequest([{"role": "user", "content": ask}], max_tokens, ignore_eos=False))
    else:
        raise ValueError(f"a copy workload is edit or summary, not {kind!r}")
    return out


def token_workload(
    n: int, prompt_len=(16, 256), output_len=(16, 128), vocab: int = 49152, seed: int = 0, first_id: int = 17
) -> list[LoadRequest]:
    """n completions of random token ids, prompt lengths and max_tokens drawn uniformly from the
    two ranges (seeded; a new seed is a new workload, so no prompt cache helps). Ids start at
    `first_id`, past SmolLM2's special tokens."""
    rng = random.Random(seed)
    return [
        LoadRequest(
            None,
            rng.randint(*output_len),
            [rng.randrange(first_id, vocab) for _ in range(rng.randint(*prompt_len))],
        )
        for _ in range(n)
    ]


async def stream_one(
    client, url: str, req: LoadRequest, headers: dict, model: str | None = None
) -> RequestResult:
    """One streaming request, timed chunk by chunk: chat, or completions for a token-id prompt.

    Tokens per chunk are counted from `token_ids` (nanoserve's extension) or `tokens` (what
    llama.cpp's server sends when asked with `return_tokens`); a server that sends neither is
    taken at one token per chunk with text, and its final `usage` has the last word."""
    res = RequestResult(asked=req.max_tokens, may_stop=not req.ignore_eos)
    body = {
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": req.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    if req.prompt is not None:
        route = "/v1/completions"
        body |= {"prompt": req.prompt, "return_tokens": True, "cache_prompt": False}
    else:
        route = "/v1/chat/completions"
        body["messages"] = req.messages
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + route, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    break
                if chunk.get("usage"):
                    res.usage_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if "token_ids" in choice:
                        n = len(choice["token_ids"] or [])
                    elif isinstance(chunk.get("tokens"), list):
                        n = len(chunk["tokens"])
                    else:
                        n = 1 if (choice.get("text") or (choice.get("delta") or {}).get("content")) else 0
                    now = time.perf_counter()
                    if n:
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itls.extend([(now - last) / n] * n)
                        last = now
                        res.tokens += n
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
    except Exception as e:  # a client-side failure counts as an incomplete request, with its reason
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    return res


async def run_load(
    url: str,
    reqs: list[LoadRequest],
    concurrency: int = 16,
    api_key: str | None = None,
    timeout: float = 600,
    model: str | None = None,
) -> LoadReport:
    """Send every request, `concurrency` at a time (each client takes the next request when its
    previous one finishes)."""
    import httpx

    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency is the number of clients, at least 1, got {concurrency!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[RequestResult | None] = [None] * len(reqs)
    todo = iter(range(len(reqs)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker():
            for i in todo:
                results[i] = await stream_one(client, url, reqs[i], headers, model)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    return LoadReport(results, seconds, concurrency)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """The send times, in seconds from the start, of n requests arriving as a Poisson process at
    `rate` requests per second: each gap is drawn from an exponential distribution of mean
    1 / rate by `random.Random(seed)`, and the first request waits one gap too. `rate` inf sends
    every request at 0 (vLLM's default, all at once)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n is a number of requests, 0 or more, got {n!r}")
    if not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
        raise ValueError(
            f"rate is requests per second and must be more than 0 (inf: all at once), got {rate!r}"
        )
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


async def run_open_loop(
    url: str,
    reqs: list[LoadRequest],
    rate: float,
    seed: int = 0,
    api_key: str | None = None,
    timeout: float = 600,
    model: str | None = None,
) -> LoadReport:
    """Send request i at `poisson_arrivals(len(reqs), rate, seed)[i]` seconds from the start,
    whether or not the earlier ones have been answered (an open loop: no client waits for the
    server). Each request's TTFT is timed from its own send, so time spent in the server's queue
    counts. The report's `concurrency` is the most requests that were in flight at once."""
    import httpx

    arrivals = poisson_arrivals(len(reqs), rate, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    in_flight, peak = 0, 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def send(i: int) -> RequestResult:
            nonlocal in_flight, peak
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            sent_at = time.perf_counter() - t0
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                res = await stream_one(client, url, reqs[i], headers, model)
            finally:
                in_flight -= 1
            res.sent_at = sent_at
            return res

        results = await asyncio.gather(*(send(i) for i in range(len(reqs))))
        seconds = time.perf_counter() - t0
    return LoadReport(list(results), seconds, peak, rate=rate)


def goodput(report: LoadReport, ttft_ms: float | None = None, tpot_ms: float | None = None) -> dict:
    """Goodput under a service-level objective (DistServe's definition, vLLM's `--goodput`): the
    requests that came back whole with TTFT <= `ttft_ms` and TPOT <= `tpot_ms` (each bound in
    milliseconds; a bound left None is not checked, at least one is needed), per second of the
    run, and as a share of all requests. A request of one token has no TPOT and meets that bound."""
    bounds = {"ttft": ttft_ms, "tpot": tpot_ms}
    if all(b is None for b in bounds.values()):
        raise ValueError("goodput needs at least one bound: ttft_ms or tpot_ms")
    for name, b in bounds.items():
        if b is not None and (not isinstance(b, (int, float)) or math.isnan(b) or b <= 0):
            raise ValueError(f"{name}_ms is a bound in milliseconds and must be more than 0, got {b!r}")
    if not report.seconds > 0:
        raise ValueError(f"the report's run took {report.seconds!r} s; goodput is per second of a run")

    def good(r: RequestResult) -> bool:
        if not r.complete or r.ttft is None:
            return False
        if ttft_ms is not None and 1000 * r.ttft > ttft_ms:
            return False
        tpot = r.tpot if r.tpot is not None else 0.0
        return tpot_ms is None or 1000 * tpot <= tpot_ms

    n = sum(good(r) for r in report.results)
    total = len(report.results)
    return {
        "slo_ttft_ms": ttft_ms if ttft_ms is not None else "",
        "slo_tpot_ms": tpot_ms if tpot_ms is not None else "",
        "good": n,
        "good_share": round(n / total, 3) if total else float("nan"),
        "goodput_req_s": round(n / report.seconds, 2),
    }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(report: LoadReport) -> dict:
    """The figures a serving benchmark quotes, in milliseconds and per second."""
    rs = report.results
    ttft = [r.ttft for r in rs if r.ttft is not None]
    itl = [x for r in rs for x in r.itls]
    tpot = [r.tpot for r in rs if r.tpot is not None]
    tokens = sum(r.output_tokens for r in rs)
    ms = lambda xs, q: round(1000 * percentile(xs, q), 1)
    arrivals = {} if report.rate is None else {"request_rate": report.rate}
    return {
        "requests": len(rs),
        **arrivals,
        "concurrency": report.concurrency,
        "incomplete": sum(not r.complete for r in rs),
        "output_tokens": tokens,
        "seconds": round(report.seconds, 2),
        "output_tok_s": round(tokens / report.seconds, 1),
        "req_s": round(len(rs) / report.seconds, 2),
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
        "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99),
    }


def stall_seconds_observed(itls: list[float]) -> float:
    """Time a stream spent above its typical gap: sum of (gap - median gap) over gaps longer
    than twice the median. A lazily capturing server pays its recordings here."""
    if not itls:
        return 0.0
    med = statistics.median(itls)
    return sum(x - med for x in itls if x > 2 * med)
