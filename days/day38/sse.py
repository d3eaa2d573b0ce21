"""Day 38's table: streamed answers as server-sent events, frame by frame, against the whole answer.

SmolLM2-135M-Instruct behind `create_app` on loopback. For each route (completions, chat) and
answer length, the same greedy request twice: once with `stream: true` and
`stream_options.include_usage`, read as raw bytes the moment they arrive, and once whole.
`day-38-frames.csv` keeps, per request:

* the frames of the stream (events, the blank-line-separated units of SSE), of which how many
  carried text, whether the last JSON frame was the usage chunk and the stream ended with
  `[DONE]`, the bytes on the wire for the stream and for the whole answer;
* whether the stream's text equals the whole answer's, and its usage the same;
* this machine's times (not facts): the first frame, the first frame with text, the last frame,
  and the whole answer.

The parser is SSE's own rule: an event ends at a blank line, and its `data:` lines are joined
with newlines. `naive_events` is the shortcut of taking every `data:` line as an event, which
gives the same answer on this server's streams (one line per event) and not on others.

    python days/day38/sse.py                        # writes day-38-frames.csv next to this file
    python days/day38/sse.py --lengths 16 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
import torch

from nanocourse import engine_config, served, write_csv
from nanoserve.engine import Engine

HERE = Path(__file__).resolve().parent
MODEL_NAME = "SmolLM2-135M-Instruct"
HTTP = httpx.Client(timeout=120)
PROMPT = "Once upon a time, in a small village by the sea,"
MESSAGES = [{"role": "user", "content": "Tell me about lighthouses."}]
ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def make_engine(model, tokenizer) -> Engine:
    """SmolLM2 on a 32 MiB pool (720 tokens), 8 rows, the default (packed) linears."""
    engine = Engine(model, tokenizer, engine_config(38, max_batch=8, max_model_len=512, kv_budget=32 * 2**20))
    engine.model_name = MODEL_NAME
    return engine


def body(route: str, max_tokens: int, stream: bool) -> dict:
    b = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    b |= {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    return b | ({"stream_options": {"include_usage": True}} if stream else {})


# --- reading a stream ---------------------------------------------------------------------------


def stream_raw(url: str, route: str, max_tokens: int) -> tuple[list[tuple[float, bytes]], dict]:
    """The stream's bytes as they arrived: [(seconds since the request was sent, bytes)], and
    the response headers."""
    t0 = time.perf_counter()
    chunks = []
    with HTTP.stream("POST", url + ROUTES[route], json=body(route, max_tokens, True)) as r:
        assert r.status_code == 200, r.read()
        for piece in r.iter_raw():
            chunks.append((time.perf_counter() - t0, piece))
        headers = dict(r.headers)
    return chunks, headers


class EventParser:
    """SSE's framing, fed bytes in any pieces: an event ends at a blank line; its `data:` lines
    (one optional space after the colon) are joined with a newline; comment lines (starting
    with ':') and other fields are skipped. The buffer is bytes and a block is decoded only when
    it is whole, so a character split between two pieces is never cut. Line ends are LF, as
    this server, vLLM's and OpenAI's send them (the specification also allows CRLF and CR)."""

    def __init__(self):
        self.buffer = b""

    def feed(self, piece: bytes) -> list[str]:
        self.buffer += piece
        events = []
        while b"\n\n" in self.buffer:
            block, self.buffer = self.buffer.split(b"\n\n", 1)
            lines = block.decode().split("\n")
            data = [ln[5:].removeprefix(" ") for ln in lines if ln.startswith("data:")]
            if data:
                events.append("\n".join(data))
        return events


def parse_events(raw: bytes, piece: int | None = None) -> list[str]:
    """Every event's data in raw, fed whole or in pieces of `piece` bytes."""
    parser, out = EventParser(), []
    for i in range(0, len(raw), piece or max(len(raw), 1)):
        out += parser.feed(raw[i : i + (piece or len(raw))])
    return out


def naive_events(raw: bytes) -> list[str]:
    """The shortcut: split on every newline, take each `data: ` line as a whole event."""
    return [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]


def stream_text(events: list[str]) -> tuple[str, dict | None]:
    """The text the events carry (completions' `text`, chat's `delta.content`) and the usage."""
    text, usage = "", None
    for e in events:
        if e == "[DONE]":
            break
        chunk = json.loads(e)
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, usage


def whole_text(answer: dict) -> str:
    c = answer["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def has_text(event: str) -> bool:
    if event == "[DONE]":
        return False
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in json.loads(event)["choices"])


# --- the table ----------------------------------------------------------------------------------


def frames_row(url: str, route: str, max_tokens: int) -> dict:
    """Stream the request, then send it whole; one table row."""
    chunks, _ = stream_raw(url, route, max_tokens)
    t0 = time.perf_counter()
    whole = HTTP.post(url + ROUTES[route], json=body(route, max_tokens, False))
    return summarize(route, max_tokens, chunks, whole, time.perf_counter() - t0)


def event_ends(chunks: list[tuple[float, bytes]]) -> list[float]:
    """When each event was complete: the arrival time of the piece that holds its blank line."""
    raw, ends, seen, arrived = b"".join(p for _, p in chunks), [], 0, []
    for t, p in chunks:
        seen += len(p)
        arrived.append((seen, t))
    offset = 0
    for e in raw.split(b"\n\n")[:-1]:
        offset += len(e) + 2
        ends.append(next(t for n, t in arrived if n >= offset))
    return ends


def summarize(route: str, max_tokens: int, chunks, whole: httpx.Response, whole_s: float) -> dict:
    """One table row from a stream's pieces and the same request's whole response."""
    raw = b"".join(p for _, p in chunks)
    events, ends = parse_events(raw), event_ends(chunks)
    text, usage = stream_text(events)
    answer = whole.json()
    first_text = next(i for i, e in enumerate(events) if has_text(e))
    last_json = json.loads(events[-2])
    return {
        "route": route,
        "max_tokens": max_tokens,
        "frames": len(events),
        "text_frames": sum(map(has_text, events)),
        "usage_frame": "yes" if last_json["choices"] == [] and last_json.get("usage") else "no",
        "done": "yes" if events[-1] == "[DONE]" else "no",
        "completion_tokens": usage["completion_tokens"],
        "stream_bytes": len(raw),
        "whole_bytes": len(whole.content),
        "same_text": "yes" if text == whole_text(answer) else "no",
        "same_usage": "yes" if usage == answer["usage"] else "no",
        "first_frame_ms": round(ends[0] * 1000, 1),
        "first_text_ms": round(ends[first_text] * 1000, 1),
        "last_frame_ms": round(ends[-1] * 1000, 1),
        "whole_ms": round(whole_s * 1000, 1),
    }


def main() -> None:
    from nanoserve.bench import cpu_line
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 96], help="max_tokens values")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE / "day-38-frames.csv")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = fetch_default_model()
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    rows = []
    with served(make_engine(model, tok)) as url:
        for route in ROUTES:
            for n in args.lengths:
                rows.append(frames_row(url, route, n) | {"cpu": cpu_line()})  # its ms are this machine's
                print(rows[-1])
    write_csv(rows, args.out)


if __name__ == "__main__":
    main()
