# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Day 38 — Streaming with server-sent events
#
# A whole answer arrives when its last token does. On this CPU a 96-token answer takes seconds,
# and for all of them a chat window would show nothing. The engine has had the tokens one step
# at a time since Day 10; today the server passes them on as they come, with `stream: true`, in
# the format OpenAI's API uses: server-sent events (SSE). The response stays open with content
# type `text/event-stream`, and each piece of the answer is written as an *event*: one or more
# lines of the form `data: ...`, ended by a blank line. Each event's data is a JSON chunk shaped
# like a small completion, and a last event whose data is the bare string `[DONE]` closes the
# stream.
#
# The format is simple enough to get subtly wrong on either side. The stream's pieces must add
# up to exactly the answer a non-streamed request gets, the token counts (`usage`) must arrive
# somewhere, and the client has to cut the byte stream into events where SSE says to, at blank
# lines, whatever sizes the network hands it the bytes in.
#
# 1. a stream as it comes off the socket: the headers, the raw bytes, the pieces they arrived in,
# 2. cutting it into events, in a few lines, against the `openai` package's own decoder, whole
#    and fed in 7-byte pieces,
# 3. the events: text chunks, the finish reason, the usage chunk, `[DONE]`; the stream's text
#    equal to the whole answer, on completions and on chat,
# 4. time to the first frame against time to the whole answer,
# 5. a stop string that arrives split over two tokens: the text that may begin it held back, by
#    hand, against the package's `StopStrings` and the server,
# 6. a client that cuts at every newline instead of at blank lines, caught,
# 7. the day's table (`days/day38/sse.py`) and the diagram.

# %%
import json
import re
import sys
import time

import matplotlib
import openai
import torch
from openai._streaming import SSEDecoder  # the official client's own SSE parser

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve.bench import cpu_line
from nanoserve.models import load_model
from nanoserve.stopping import StopStrings
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day38"))
import sse  # the day's script: the notebook uses its reader and reads its table

torch.set_num_threads(1)  # the machine is shared; one thread keeps the timings comparable
print(cpu_line())
MODEL_DIR = fetch_default_model()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
engine = sse.make_engine(model, tok)  # engine_config(38, ...): the engine of day 34
server = sse.served(engine)
url = server.__enter__()  # uvicorn on a free port of 127.0.0.1, in a thread; closed at the end
print("serving", sse.HTTP.get(url + "/v1/models").json()["data"][0]["id"], "on http://127.0.0.1:PORT")


def masked(text):
    """A frame as printed here: the request's random id and its clock time masked."""
    return re.sub(r'"created": \d+', '"created": …', re.sub(r"(cmpl|chatcmpl)-[0-9a-f]{24}", r"\1-…", text))


# %% [markdown]
# ## 1. A stream, as bytes
#
# A greedy completion of 16 tokens with `stream: true` and `stream_options: {"include_usage":
# true}`, read with httpx's `iter_raw`: the bytes exactly as the socket delivered them, each
# piece stamped with its arrival time (`sse.stream_raw`). The headers first: besides the content
# type, `Cache-Control: no-cache` and `X-Accel-Buffering: no` ask any proxy in between (nginx
# reads the second) to pass the bytes on at once rather than collect the whole response.

# %%
N = 16
chunks, headers = sse.stream_raw(url, "completions", N)
raw = b"".join(p for _, p in chunks)
shown = ("content-type", "cache-control", "x-accel-buffering", "transfer-encoding")
print({k: headers.get(k) for k in shown})
print(f"{len(raw):,} bytes; the first two frames and the last three, as sent:")
frames = raw.split(b"\n\n")
for f in [*frames[:2], b"...", *frames[-4:-1]]:
    print("  ", masked(repr(f + b"\n\n" if f != b"..." else f)[2:-1]))

# %% [markdown]
# How the bytes arrived: uvicorn writes each event as soon as the handler yields it, so on
# loopback the pieces are usually one event each, each a decode step after the last; nothing
# guarantees that, and a proxy or a slow network merges and splits them freely.

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
print(f"{len(chunks)} pieces read for {len(frames) - 1} events")
for t, p in chunks[:4] + chunks[-3:]:
    print(f"  {t * 1000:8.1f} ms  {len(p):4d} bytes  {masked(p[:60].decode(errors='replace'))!r}")

# %% [markdown]
# ## 2. Cutting the stream into events
#
# SSE's rule, in a few lines: an event ends at a blank line (`\n\n`); inside it, every line
# that starts with `data:` contributes its rest (one space after the colon dropped), and several
# such lines are joined with a newline; other lines (comments starting with `:`, the `event:`,
# `id:` and `retry:` fields) are not data. The check is the `openai` package's own decoder
# (`openai._streaming.SSEDecoder`, a private class, so this pins the installed version), on the
# whole stream and on the same bytes cut into 7-byte pieces, which splits events (and JSON
# strings, and possibly a UTF-8 character) in the middle. The script's incremental
# `sse.EventParser` must agree on both.


# %%
def events_of(raw):
    out = []
    for block in raw.split(b"\n\n")[:-1]:  # the bytes after the last blank line are unfinished
        lines = block.decode().split("\n")
        data = [ln[5:].removeprefix(" ") for ln in lines if ln.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def openai_events(pieces):
    return [e.data for e in SSEDecoder().iter_bytes(iter(pieces))]


sevens = [raw[i : i + 7] for i in range(0, len(raw), 7)]
ours = events_of(raw)
assert ours == openai_events([raw]) == openai_events(sevens)
assert ours == sse.parse_events(raw) == sse.parse_events(raw, piece=7)
print(f"{len(ours)} events; the same from the openai decoder and from EventParser, whole and in "
      f"{len(sevens)} pieces of 7 bytes")  # fmt: skip

# %% [markdown]
# ## 3. The events, and the text they add up to
#
# Sixteen chunks carry one token's text each, the last of them with `finish_reason`; then,
# because of `include_usage`, one chunk with an empty `choices` list and the `usage`
# (every earlier chunk carries `"usage": null`, so a client knows the field will come); then
# `[DONE]`. The text of the chunks, joined, must be the whole answer of the same request sent
# without `stream`, and the usage chunk must equal its usage.

# %%
kinds = []
for e in ours:
    if e == "[DONE]":
        kinds.append("[DONE]")
        continue
    c = json.loads(e)
    kinds.append("usage" if not c["choices"] else f"text+{c['choices'][0]['finish_reason']}"
                 if c["choices"][0]["finish_reason"] else "text")  # fmt: skip
print("event kinds:", " ".join(f"{k}x{kinds.count(k)}" for k in dict.fromkeys(kinds)))
text, usage = sse.stream_text(ours)
t0 = time.perf_counter()
whole_response = sse.HTTP.post(url + "/v1/completions", json=sse.body("completions", N, False))
whole_s = time.perf_counter() - t0
whole = whole_response.json()
print("streamed:", repr(text))
print("whole:   ", repr(whole["choices"][0]["text"]), whole["choices"][0]["finish_reason"])
print("usage chunk:", usage)
assert text == whole["choices"][0]["text"] and usage == whole["usage"] and kinds[-2:] == ["usage", "[DONE]"]
assert json.loads(ours[0])["usage"] is None

# %% [markdown]
# Without `include_usage` there is no usage chunk and no `usage` key at all (one token is
# enough to see it):

# %%
plain = sse.HTTP.post(url + "/v1/completions", json={"prompt": sse.PROMPT, "max_tokens": 1, "stream": True})
plain_events = events_of(plain.content)
print(len(plain_events), "events:", [masked(e)[:70] for e in plain_events])
assert len(plain_events) == 2 and "usage" not in json.loads(plain_events[0])

# %% [markdown]
# The chat route streams the same way, with `delta`s instead of `text`: its first chunk carries
# only the role (`{"role": "assistant", "content": ""}`), then one chunk per piece of content.
# Through the `openai` client (which parses with the decoder above), against the whole chat
# answer:

# %%
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
kw = dict(model=sse.MODEL_NAME, messages=sse.MESSAGES, max_tokens=8, temperature=0)
stream = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
whole_chat = client.chat.completions.create(**kw)
pieces = [c.choices[0].delta.content for c in stream if c.choices]
print("first chunk's delta:", stream[0].choices[0].delta.model_dump(exclude_none=True))
print("pieces:", pieces)
print("whole: ", repr(whole_chat.choices[0].message.content), whole_chat.choices[0].finish_reason)
assert "".join(p or "" for p in pieces) == whole_chat.choices[0].message.content
assert stream[-1].choices == [] and stream[-1].usage == whole_chat.usage
assert [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason] == ["length"]

# %% [markdown]
# ## 4. Time to the first frame, and to the whole answer
#
# Streaming does not make the answer faster: the same steps produce the same tokens. What it
# changes is when the client sees something. The first frame with text leaves the server as soon
# as the prompt's prefill has produced the first token; the whole answer leaves after the last.

# %%
# NBVAL_IGNORE_OUTPUT
ends = sse.event_ends(chunks)  # when each event was whole: the arrival of its blank line
print(cpu_line())
print(f"this run, {N} tokens: first text frame {ends[0] * 1000:.0f} ms, last frame {ends[-1] * 1000:.0f} ms, "
      f"the whole answer (sent separately) {whole_s * 1000:.0f} ms")  # fmt: skip

# %% [markdown]
# The script measures both routes at 16, 32 and 96 tokens. Its deterministic columns, checked
# against the committed CSV (the journal's table; its first row is the request of sections 1
# and 3, summarized here from this run's bytes), and then its times:

# %%
table = read_csv(REPO / "days" / "day38" / "day-38-frames.csv")
facts = ["route", "max_tokens", "frames", "text_frames", "usage_frame", "done", "completion_tokens",
         "stream_bytes", "whole_bytes", "same_text", "same_usage"]  # fmt: skip
for r in table:
    extra = (int(r["stream_bytes"]) - int(r["whole_bytes"])) / int(r["completion_tokens"])
    print("  ".join(f"{k}={r[k]}" for k in facts), f"| {extra:.0f} extra bytes a token")
assert all(r["same_text"] == r["same_usage"] == r["usage_frame"] == r["done"] == "yes" for r in table)
live = sse.summarize("completions", N, chunks, whole_response, whole_s)
assert [str(live[k]) for k in facts] == [table[0][k] for k in facts]

# %%
# NBVAL_IGNORE_OUTPUT
for r in table:
    print(f"{r['route']:>11} {r['max_tokens']:>3} tokens: first frame {float(r['first_frame_ms']):7.1f} ms, "
          f"first text {float(r['first_text_ms']):7.1f} ms, last frame {float(r['last_frame_ms']):8.1f} ms, "
          f"whole answer {float(r['whole_ms']):8.1f} ms")  # fmt: skip

# %% [markdown]
# Two things in the table are worth a second look. The stream costs many more bytes than the
# answer: every chunk repeats the id, the object name, the clock time, the model's name and an
# empty logprobs field around a few characters of text, so each token costs over 200 bytes more
# streamed than in the whole answer (printed per row above), and a 96-token stream is over 30
# times the size of its whole answer. And the chat route's first frame comes before its
# first text: the role chunk goes out as soon as the engine has accepted the request, without
# waiting for the prefill that makes the first token.
#
# ## 5. Holding back what may begin a stop string
#
# A request may name stop strings: the answer ends where the first of them appears, and the stop
# string itself is left out of the text (OpenAI's rule; day 36's `stop: ["."]` request ended that
# way). Streamed, that is harder than it looks, because a stop string can arrive split over two
# tokens. In section 3's answer `". He"` is the piece `"."` of one token followed by `" He"` of the
# next. A server that sends every piece the moment it is decoded has sent the `"."` before the
# `" He"` shows it was the start of the stop string, and an event once sent cannot be taken back.
#
# The remedy: hold back the longest end of the text so far that could still be the start of a
# stop string, and release it when the next piece settles the question either way. By hand, beside
# the send-at-once version, over the pieces of section 3's stream:


# %%
def send_at_once(pieces, stop):
    """Each piece goes out as it is decoded; once the stop string shows, what is left before it."""
    sent, text = [], ""
    for p in pieces:
        text += p
        if stop in text:  # cut before the stop string: empty if its start has gone out already
            sent.append(text[len("".join(sent)) : text.index(stop)])
            return sent
        sent.append(p)
    return sent


def held_back(pieces, stop):
    """The same, holding back the longest end of the text that could begin the stop string."""
    sent, held = [], ""
    for p in pieces:
        text = held + p
        if stop in text:
            sent.append(text[: text.index(stop)])
            return sent
        keep = max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        sent.append(text[: len(text) - keep])
        held = text[len(text) - keep :]
    return sent + [held]  # it ended for another reason: what was held is text after all


STOP = ". He"
pieces16 = [json.loads(e)["choices"][0]["text"] for e in ours[:-2]]  # the 16 text chunks
k = next(i for i, p in enumerate(pieces16) if STOP in p + pieces16[i + 1])
assert STOP not in pieces16[k] and STOP not in pieces16[k + 1]  # split over two tokens
naive, hand = send_at_once(pieces16, STOP), held_back(pieces16, STOP)
stops, package = StopStrings((STOP,)), []  # the package's: what the engine runs on every piece
for p in pieces16:
    out, stopped = stops.feed(p)
    package.append(out)
    if stopped:
        break
else:
    package.append(stops.flush())
for i in range(k - 1, k + 2):
    print(f"piece {i}: {pieces16[i]!r:<8} sent at once {naive[i]!r:<8} held back {hand[i]!r}")
full = whole["choices"][0]["text"]  # section 3's answer, sent whole
cut = full[: full.index(STOP)]  # the answer a stop at ". He" leaves
print("the client's text, sent at once:", repr("".join(naive)))
print("the client's text, held back:   ", repr("".join(hand)))
assert "".join(naive) == cut + STOP[0]  # it saw the stop string's first character
assert "".join(hand) == cut and hand == package
print("hand hold-back == StopStrings.feed, piece for piece")

# %% [markdown]
# Sent at once, the client ends with a full stop the answer does not have. Held back, the `"."`
# of piece 10 waits one piece, and since the next piece completes the stop string it is never
# sent. The hand version gives the package's `StopStrings` (`nanoserve/stopping.py`) piece for
# piece. When no stop string comes, holding back only delays: with a stop string the answer
# does not contain, the `"."` goes out one piece late and the text is the whole answer. And the
# server, asked to stream with the same stop string, sends exactly the held-back text:

# %%
late = held_back(pieces16, ". She")
print(f"stop '. She': piece {k} sends {late[k]!r}, piece {k + 1} sends {late[k + 1]!r}")
assert "".join(late) == full and late[k + 1] == "." + pieces16[k + 1]
reply = sse.HTTP.post(url + "/v1/completions", json=sse.body("completions", N, True) | {"stop": [STOP]})
served_events = events_of(reply.content)
sent_pieces = [c["choices"][0]["text"] for c in map(json.loads, served_events[:-2]) if c["choices"]]
print("the server's last pieces:", sent_pieces[-3:], "| finish_reason:",
      json.loads(served_events[-3])["choices"][0]["finish_reason"])  # fmt: skip
assert "".join(sent_pieces) == cut and "." not in "".join(sent_pieces)

# %% [markdown]
# The server's last text event is empty and carries `finish_reason` `stop`: the full stop held
# back after `"old"` never went out.
#
# ## 6. A client that cuts at every newline
#
# A common shortcut is to read the response line by line and treat every `data: ` line as an
# event. On this server's streams it works, because every event here is exactly one `data:`
# line: the JSON is written on one line and JSON escapes newlines inside strings. But it is not
# what SSE says, and a server is free to spread one event's data over several `data:` lines.
# Below, the very same events are framed that way (the JSON written with indentation, one
# `data:` line per line of JSON): the correct parser, and the openai decoder, read the same
# events as before; the shortcut hands half-objects to the JSON parser. The check that catches
# it is the one of section 3, the stream's text against the whole answer.


# %%
def reframed(events):
    """The same events, each event's data written as one `data:` line per line of pretty JSON."""
    out = b""
    for e in events:
        body = e if e == "[DONE]" else json.dumps(json.loads(e), indent=1)
        out += "".join(f"data: {line}\n" for line in body.split("\n")).encode() + b"\n"
    return out


def check_stream(events, answer):
    got, _ = sse.stream_text(events)
    assert got == answer, f"the stream's text {got!r} is not the answer {answer!r}"


other = reframed(ours)
print(f"re-framed: {len(other):,} bytes, {other.count(b'data:')} data lines for {len(ours)} events")
print("  ", masked(repr(other[:125].decode())[1:-1]), "...")
answer = whole["choices"][0]["text"]
check_stream(sse.naive_events(raw), answer)  # the shortcut on this server's own stream: fine
assert [json.loads(e) for e in events_of(other)[:-1]] == [json.loads(e) for e in ours[:-1]]
assert events_of(other) == openai_events([other]) and events_of(other)[-1] == "[DONE]"
check_stream(events_of(other), answer)  # SSE's rule: the same events, the same text
try:
    check_stream(sse.naive_events(other), answer)
except (json.JSONDecodeError, AssertionError) as e:
    print("newline splitter on the re-framed stream ->", type(e).__name__ + ":", str(e)[:80])
else:
    raise AssertionError("the newline splitter read a multi-line event correctly")

# %% [markdown]
# ## 7. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9))
fig.suptitle("Day 38 — streaming with server-sent events (SmolLM2-135M, CPU)", fontsize=14)

ax = axes[0, 0]
ax.step([0] + [t * 1000 for t in ends], [0] + list(range(1, len(ends) + 1)), where="post",
        label="streamed: events received")  # fmt: skip
ax.axvline(whole_s * 1000, color="tab:red", ls="--", label="the whole answer arrives (separate request)")
ax.set_xlabel("ms since the request was sent (this run)")
ax.set_ylabel("events received")
ax.set_title(f"one {N}-token completion: when the client has something")
ax.legend(fontsize=9, loc="lower right")

ax = axes[0, 1]
sizes = [len(f) + 2 for f in frames[:-1]]
colors = {"text": "tab:blue", "usage": "tab:orange", "[DONE]": "tab:gray"}
ax.bar(range(len(sizes)), sizes, color=[colors.get(k, "tab:green") for k in kinds])
ax.set_xticks(range(len(sizes)), [k.replace("text+", "") if k != "text" else "" for k in kinds], rotation=60,
              fontsize=8)  # fmt: skip
ax.set_ylabel("bytes on the wire")
ax.set_title("bytes per event: text (blue), last text with finish (green), usage, [DONE]")

ax = axes[1, 0]
for route, marker in (("completions", "o"), ("chat", "s")):
    rows_r = [r for r in table if r["route"] == route]
    n = [int(r["max_tokens"]) for r in rows_r]
    ax.plot(n, [float(r["first_text_ms"]) for r in rows_r], marker + "-", label=f"{route}: first text frame")
    ax.plot(n, [float(r["whole_ms"]) for r in rows_r], marker + "--", label=f"{route}: whole answer")
ax.set_xlabel("max_tokens")
ax.set_ylabel("ms (the script's run)")
ax.set_yscale("log")
ax.set_title("first text frame against the whole answer")
ax.legend(fontsize=8)

ax = axes[1, 1]
x = range(len(table))
ax.bar([i - 0.2 for i in x], [int(r["stream_bytes"]) for r in table], 0.4, label="stream")
ax.bar([i + 0.2 for i in x], [int(r["whole_bytes"]) for r in table], 0.4, label="whole answer")
ax.set_xticks(list(x), [f"{r['route']}\n{r['max_tokens']}" for r in table], fontsize=8)
ax.set_yscale("log")
ax.set_ylabel("response bytes")
ax.set_title("what the stream costs on the wire")
ax.legend(fontsize=9)
fig.tight_layout()
path = diagram_path("day38-sse.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %%
server.__exit__(None, None, None)  # the server and its engine loop stop here
print("server stopped; blocks still held:", engine.allocator.num_used)

# %% [markdown]
# ## In the real systems
#
# * **vLLM** streams from `serving_completion.py` and `serving_chat.py` the same way: each chunk
#   is written as `data: {json}\n\n`, a final `data: [DONE]\n\n` ends the stream, and with
#   `stream_options.include_usage` a last chunk with empty `choices` carries the usage;
#   `continuous_usage_stats` is vLLM's extra that puts a running usage in every chunk instead.
# * **llama.cpp**'s `llama-server` streams its own `/completion` endpoint and the OpenAI routes
#   as SSE, also one `data:` line per event; **TGI** streams `/generate_stream` as SSE too,
#   with one token and its details per event.
# * **The `openai` package** parses with an SSE decoder of its own (`openai._streaming`) that
#   joins multi-line data, skips comments and stops at `[DONE]`, which is why it read the
#   re-framed stream of section 6 correctly. nanoserve's own load generator (`loadgen.py`,
#   Day 43) reads line by line, which is right for the one-line events this server, vLLM's
#   and OpenAI's send, and would report a multi-line event as a failed request.
#
# ## Try it
#
# 1. **Break the decoder on purpose.** Change `events_of` to split on `b"\n"` instead of
#    `b"\n\n"`. The check: section 2's asserts still pass (every event of this server is one
#    line, and the empty blocks carry no data), but section 6's `events_of(other) ==
#    openai_events([other])` fails: the decoder has become the newline splitter.
# 2. **Send a keep-alive comment.** Insert `b": ping\n\n"` between two frames of `raw` and parse
#    it with `events_of` and `openai_events`. The check: both return the same events as
#    before, and so does `sse.naive_events` (a comment is not a `data:` line); a proxy that
#    closes idle connections is kept from doing so by such comments.
# 3. **Count the bytes of a token.** From the table, compute `(stream_bytes - whole_bytes) /
#    completion_tokens` per row (section 4 prints it). The check: it is nearly constant per
#    route (the chunk's boilerplate), and larger on chat, whose chunks carry a `delta` object,
#    a longer object name and a longer id.
