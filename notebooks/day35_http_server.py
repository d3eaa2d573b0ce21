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
# # Day 35 — An HTTP server
#
# Yesterday the engine got its four calls, and a loop around `step()` was all a caller had to
# write. Today the caller is on the other side of a socket. `nanoserve.serve.create_app(engine)`
# returns a FastAPI app that speaks a subset of OpenAI's API: a client sends a JSON body to
# `POST /v1/completions`, a handler checks it and hands it on, the engine's tokens come back
# as the same JSON any OpenAI client reads. Clients already exist in every language, and a
# benchmark or an application written against OpenAI can be pointed at us by changing one URL.
#
# The engine is not thread-safe, and the server has many requests in the air at once, so the
# app does not call `step()` from its handlers. It starts one thread, the engine loop, that
# alone owns the engine: handlers put requests in its inbox and read their outputs from a queue
# of their own. (Day 47 is that loop's own day; today it is simply there.)
#
# Nothing in this notebook calls a handler directly. The app is served by uvicorn on a free
# port of 127.0.0.1 in a background thread of this process, and every request below is real
# HTTP, through httpx or the official `openai` package.
#
# 1. the engine and its own answer, taken before the server owns it,
# 2. the routes, read from the app,
# 3. the server boots: the boot line and `/health`,
# 4. `GET /v1/models`,
# 5. a first completion through httpx, and the same through the `openai` client, equal to the
#    engine's own tokens,
# 6. a request that leaves `temperature` out: a check that catches it,
# 7. a route that does not exist, a wrong method, a model that is not served: status codes,
# 8. the day's script's requests (`days/day35/firstrequest.py`), and the shutdown,
# 9. the diagram.

# %%
import contextlib
import io
import sys

import httpx
import matplotlib
import openai
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from fastapi.routing import APIRoute
from IPython.display import Image, display

from nanocourse import REPO, ServerThread, diagram_path, read_csv, tiny_llama
from nanoserve.generate import greedy_tokens
from nanoserve.serve import create_app

sys.path.insert(0, str(REPO / "days" / "day35"))
import firstrequest  # the day's script: the notebook uses its engine and its requests

torch.set_num_threads(1)
tiny = tiny_llama(0)
engine = firstrequest.make_engine(tiny)  # engine_config(35, ...): the engine of day 34, unchanged
PROMPT, N = firstrequest.PROMPT, 8

# %% [markdown]
# ## 1. The engine's own answer
#
# The tiny random-weight Llama again, without a tokenizer: a prompt is a list of token ids and
# the answer's text is empty, so the tokens come back through `return_token_ids` (an extension
# vLLM also accepts). The reference is taken now, with `Engine.generate`, because once the
# server starts only the engine loop may touch the engine. It must also be the plain greedy
# loop's answer.

# %%
own = firstrequest.engine_tokens(engine, PROMPT, N)
with torch.inference_mode():
    assert own == greedy_tokens(tiny, PROMPT, N)
print(f"prompt {PROMPT}\nthe engine's own {N} tokens: {own} (= greedy_tokens)")
print("blocks used now:", engine.allocator.num_used, "| served as:", engine.model_name)

# %% [markdown]
# ## 2. The routes
#
# Read off the app itself. Five are today's; the app as it stands later in the course has a few
# more (the tokenizer endpoints and `/version` of phase 6), listed apart. FastAPI adds four of
# its own for the schema and the interactive documentation.

# %%
app = create_app(engine)
ours = [(r.path, sorted(r.methods)) for r in app.routes if isinstance(r, APIRoute)]
theirs = [r.path for r in app.routes if not isinstance(r, APIRoute)]
routes = ["/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"]
for path, methods in ours:
    if path in routes:
        print(f"{'/'.join(methods):>5} {path}")
print("added on later days:", [p for p, _ in ours if p not in routes])
print("FastAPI's own:", theirs)
assert [p for p, _ in ours if p in routes] == routes

# %% [markdown]
# ## 3. The server boots
#
# `ServerThread` binds a free port on 127.0.0.1 and runs uvicorn in a thread. Starting the app
# runs its lifespan: with a built engine that means starting the engine loop and printing one
# boot line to stderr (model, dtype, device, the KV pool; its last field, the warm list, says
# "none" until day 55 builds warming). Then `/health` answers 200 with the pool plan.

# %%
log = io.StringIO()
server = ServerThread(app)
with contextlib.redirect_stderr(log):
    url = server.__enter__()
print("boot line:", log.getvalue().strip())
health = httpx.get(url + "/health")
h = health.json()
print("GET /health ->", health.status_code, {k: h[k] for k in ("status", "model", "max_model_len")})
print("pool:", {k: health.json()["pool"][k] for k in ("num_blocks", "block_size", "num_slots")})
assert health.status_code == 200 and health.json()["status"] == "ok"

# %% [markdown]
# ## 4. `GET /v1/models`
#
# OpenAI's list of models, with the one model this server serves. A client that asks for a
# model by name must use this one.

# %%
models = httpx.get(url + "/v1/models")
card = models.json()["data"][0]
print("GET /v1/models ->", models.status_code, models.json()["object"],
      {k: card[k] for k in ("id", "object", "owned_by", "max_model_len")})  # fmt: skip
assert card["id"] == engine.model_name

# %% [markdown]
# ## 5. A first completion
#
# By hand with httpx first, so the body is seen as it travels: model, prompt, `max_tokens`,
# `temperature` 0 for greedy, and `return_token_ids`. The reply is OpenAI's completion object;
# its `id` and `created` change on every call and are left out of the print.

# %%
body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "return_token_ids": True}
r = httpx.post(url + "/v1/completions", json=body)
reply = r.json()
print("POST /v1/completions ->", r.status_code, r.headers["content-type"])
print("keys:", sorted(reply), "| object:", reply["object"], "| id starts", reply["id"][:5])
choice = reply["choices"][0]
print("choice:", {k: choice[k] for k in ("index", "text", "finish_reason", "token_ids")})
print("usage:", reply["usage"])
assert r.status_code == 200 and choice["token_ids"] == own and choice["finish_reason"] == "length"
usage = {"prompt_tokens": len(PROMPT), "completion_tokens": N, "total_tokens": len(PROMPT) + N}
assert reply["usage"] == usage

# %% [markdown]
# Then the `openai` package, pointed at the server with `base_url`. It needs an API key to
# build, and this server asks for none, so any string does. `return_token_ids` is not one of
# its arguments, so it goes in `extra_body`, and the reply's pydantic object keeps the extra
# field.

# %%
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
print("models:", [m.id for m in client.models.list().data])
done = client.completions.create(
    model="tiny-llama", prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"return_token_ids": True}
)
print(type(done).__name__, "|", done.choices[0].finish_reason, done.choices[0].token_ids, "|", done.usage)
assert done.choices[0].token_ids == choice["token_ids"] == own
print("httpx == openai == the engine's own tokens")

# %% [markdown]
# ## 6. A request that leaves out `temperature`
#
# The check the whole day rests on is that what comes over HTTP is what the engine makes. Here
# it is as a function, and here is a request it should catch: one that leaves `temperature`
# out. OpenAI's default is 1, not 0, and the server keeps it (`temperature=1.0 if
# req.temperature is None`), so such a request samples instead of taking the most likely
# token. With a seed it samples the same way every time, so the check fails the same way on
# every run.


# %%
def check_same_as_engine(got, own):
    if got != own:
        first = next(i for i, (a, b) in enumerate(zip(got, own)) if a != b)
        raise AssertionError(f"the server's tokens differ from the engine's from token {first}: "
                             f"{got} vs {own}")


check_same_as_engine(done.choices[0].token_ids, own)
sampled = client.completions.create(
    model="tiny-llama", prompt=PROMPT, max_tokens=N, seed=0, extra_body={"return_token_ids": True}
)
try:
    check_same_as_engine(sampled.choices[0].token_ids, own)
    raise RuntimeError("a sampled answer passed as the greedy one")
except AssertionError as e:
    print("temperature left out -> caught:", e)

# %% [markdown]
# ## 7. Wrong routes, wrong methods, wrong models
#
# A path the app does not have answers 404, a method a route does not take answers 405, and a
# request for a model this server does not serve is also a 404, with OpenAI's code
# `model_not_found`. All three come back as OpenAI's error object with a sentence, not
# FastAPI's default `{"detail": ...}`, so an OpenAI client raises its usual exception.

# %%
for method, path, payload in [
    ("GET", "/v1/nothing-here", None),
    ("GET", "/v1/completions", None),
    ("DELETE", "/v1/models", None),
    ("POST", "/v1/completions", body | {"model": "gpt-4"}),
]:
    r = httpx.request(method, url + path, json=payload)
    print(f"{method:>6} {path:<18} -> {r.status_code} {r.json()['error']}")
try:
    client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
except openai.NotFoundError as e:
    print("openai client:", type(e).__name__, e.status_code, e.body["code"])

# %% [markdown]
# ## 8. The script's requests, then the shutdown
#
# `firstrequest.requests_table` sends the day's fixed list to a server (the calls above, in
# one place) and writes one row per request; the script boots its own server and writes
# `day-35-requests.csv`. Run here against this server, its deterministic columns must equal the
# committed table.

# %%
rows = firstrequest.requests_table(url, own, PROMPT, N)
committed = read_csv(firstrequest.CSV)
facts = ["client", "method", "path", "asked", "status", "error_type", "error_code", "tokens",
         "same_as_engine"]  # fmt: skip
assert [[str(r[k]) for k in facts] for r in rows] == [[r[k] for k in facts] for r in committed]
for r in rows:
    print(" | ".join(str(r[k]) for k in facts))

# %%
# NBVAL_IGNORE_OUTPUT
for r in rows:
    print(f"{r['method']:>4} {r['path']:<18} {r['client']:>6}: {r['ms']:.1f} ms")

# %% [markdown]
# Leaving `ServerThread` tells uvicorn to exit; the lifespan stops the engine loop. Every
# request above has ended, so the engine is idle with every block free, and it belongs to this
# notebook again.

# %%
server.__exit__(None, None, None)
print("server thread alive:", server.thread.is_alive(), "| loop alive:", app.state.nanoserve.loop.alive)
print("blocks used:", engine.allocator.num_used, "| unfinished:", engine.has_unfinished())
try:
    httpx.get(url + "/health", timeout=2)
except httpx.ConnectError as e:
    print("after shutdown:", type(e).__name__)
assert engine.allocator.num_used == 0 and not server.thread.is_alive()

# %% [markdown]
# ## 9. The diagram

# %%
fig, axes = plt.subplots(1, 2, figsize=(16, 5.5), gridspec_kw={"width_ratios": [1.1, 1], "wspace": 0.5})
fig.suptitle("Day 35 — the engine behind HTTP (tiny Llama, loopback, CPU)", fontsize=13)
ax = axes[0]
ax.set_xlim(0, 10)
ax.set_ylim(0, 6)
ax.axis("off")
boxes = [
    (0.2, 4.3, "client\nhttpx / openai"),
    (2.7, 4.3, "uvicorn\n127.0.0.1:PORT"),
    (5.2, 4.3, "handler\n(FastAPI route)"),
    (7.7, 4.3, "engine loop\nthread"),
    (7.7, 1.2, "Engine\nadd_request\nstep"),
]
for x, y, text in boxes:
    ax.add_patch(plt.Rectangle((x, y), 2.0, 1.2, fc="#e8eef8", ec="k"))
    ax.text(x + 1.0, y + 0.6, text, ha="center", va="center", fontsize=9)
for x0, x1 in ((2.2, 2.7), (4.7, 5.2), (7.2, 7.7)):
    ax.annotate("", (x1, 4.9), (x0, 4.9), arrowprops={"arrowstyle": "<->"})
ax.annotate("", (8.7, 2.4), (8.7, 4.3), arrowprops={"arrowstyle": "<->"})
ax.text(5.0, 3.5, "JSON body in; the loop's outputs come back\non the handler's own queue",
        ha="center", fontsize=9)  # fmt: skip
ax.text(3.8, 1.8, "only the loop thread\ntouches the engine", ha="center", fontsize=9, style="italic")
ax.set_title("a request's path")

ax = axes[1]
labels = [f"{r['method']} {r['path']}\n{r['client']} {r['asked']}".strip() for r in rows]
colors = ["tab:green" if r["status"] == 200 and r["same_as_engine"] != "no" else
          "tab:orange" if r["status"] == 200 else "tab:red" for r in rows]  # fmt: skip
ax.barh(range(len(rows)), [r["ms"] for r in rows], color=colors)
for i, r in enumerate(rows):
    same = "=" if r["same_as_engine"] == "yes" else "!="
    note = f"{r['status']}" + (f", tokens {same} engine" if r["tokens"] else "")
    ax.text(r["ms"], i, " " + note, va="center", fontsize=8)
ax.set_yticks(range(len(rows)), labels, fontsize=8)
ax.set_xlim(0, 1.5 * max(r["ms"] for r in rows))  # room for the notes right of the bars
ax.invert_yaxis()
ax.set_xlabel("round trip, ms (this run)")
ax.set_title("the script's requests: status, tokens against the engine's")
path = diagram_path("day35-http-server.png")
fig.savefig(path, dpi=80, bbox_inches="tight")
plt.close(fig)
display(Image(str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**'s server is `vllm/entrypoints/openai/api_server.py`: a FastAPI app whose routes
#   (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics` among
#   others) hand requests to `OpenAIServingCompletion` and `OpenAIServingChat`
#   (`serving_completion.py`, `serving_chat.py`). Those talk to `AsyncLLM`, and the engine core
#   runs in a separate process, so the step loop and the HTTP event loop do not share a
#   Python interpreter; ours share a process and are split by a thread instead.
# * **SGLang**'s `launch_server` starts a FastAPI server, a tokenizer manager in the server
#   process and the scheduler in another, passing requests between them over ZeroMQ.
# * **TGI** puts a Rust router (axum) at the door; it queues and batches requests and calls
#   the Python model server over gRPC. It also serves an OpenAI-style `/v1/chat/completions`.
# * **llama.cpp**'s `llama-server` is one C++ binary with its own HTTP server: `/completion`
#   (its native API), `/v1/completions` and `/v1/chat/completions`, `/health`, `/metrics`, and
#   a fixed number of slots for parallel requests.
# * All of them answer errors with an OpenAI-shaped error object, so that OpenAI's clients
#   raise their own exception types, as `openai.NotFoundError` did in section 7.
#
# ## Try it
#
# (Restart the server first: `server = ServerThread(app); url = server.__enter__()`.)
#
# 1. Send `{"prompt": PROMPT, "max_tokens": N, "return_token_ids": True}`, with no `model` and
#    no `temperature`. Check that it is served by the one model (`r.status_code == 200` and
#    `r.json()["model"] == engine.model_name`) and that `check_same_as_engine` raises on its
#    tokens: `temperature` defaults to 1, so it sampled.
# 2. Send section 6's request with `"temperature": 1.0, "seed": 0` written out and check that it
#    gives section 6's tokens, seed for seed:
#    `assert r.json()["choices"][0]["token_ids"] == sampled.choices[0].token_ids`.
# 3. Break the gate on purpose: rewrite `check_same_as_engine` to compare lengths only
#    (`if len(got) != len(own)`) and rerun section 6. The sampled answer now passes, and the
#    cell must stop with `RuntimeError: a sampled answer passed as the greedy one`.
