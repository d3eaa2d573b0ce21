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
# # Day 40 — Bad input: validation and clear errors
#
# A server open to the network gets every kind of body: a string where a number belongs, a
# field missing, a temperature of -1, a prompt ten times the context, half a JSON object, a
# field from another vendor's API. Three things must hold for each of them. The client gets a
# status code that says whose fault it was (4xx: yours) and OpenAI's error object with a
# sentence that says what to change, never a traceback. Nothing reaches the engine: a request
# that cannot be served is refused at the door, before it takes a row, a block or a step. And
# a request in flight beside it is not touched, not even slowed.
#
# One class of bad input needs a decision rather than a check: a field this server parses but
# does not implement, such as `typical_p` or `use_beam_search`. Ignoring it would answer a
# different question from the one asked, with a 200. `nanoserve.api.check_supported` refuses
# any such field set to anything but the value that changes nothing. A field of OpenAI's
# request that cannot change the answer, such as `user` (an identifier for the caller's end
# user, declared in the schema and read by nothing in the server), is accepted.
#
# 1. a few plain lines of validation of our own, against the server's answers,
# 2. the day's table (`days/day40/badinput.py`): 40 requests, the status and error object each
#    gets, sent while two healthy streams are in flight and the engine is held,
# 3. the healthy streams, and a request with a temperature of 1e-39 beside them,
# 4. a planted server whose `check_supported` lets everything through, caught,
# 5. the diagram.

# %%
import contextlib
import io
import sys
from collections import Counter

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve.bench import cpu_line
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day40"))
import badinput  # the day's script: its cases, its server run and its checks

torch.set_num_threads(1)
print(cpu_line())
tok = Tokenizer.from_dir(fetch_default_model())
model = badinput.tiny_model(tok.vocab_size)
reference = badinput.alone(badinput.make_engine(model, tok), badinput.HEALTHY, 32)
print(f"context {badinput.CONTEXT} tokens, body cap {badinput.BODY_CAP:,} bytes, {len(badinput.CASES)} cases")
with contextlib.redirect_stderr(io.StringIO()):  # the boot line and uvicorn's log stay out of the outputs
    run = badinput.poisoned_run(badinput.make_engine(model, tok), 32)
rows = run["rows"]


def committed(name):
    return read_csv(REPO / "days" / "day40" / f"day-40-{name}.csv")


# %% [markdown]
# The model is the course's tiny random-weight Llama with SmolLM2's vocabulary, so SmolLM2's
# tokenizer and chat template apply, with a 256-token context, on the engine of day 34
# (`badinput.make_engine` calls `engine_config(40, ...)`). `poisoned_run` did everything at
# once in the cell above (section 2 and 3 take it apart): two healthy streams started, the
# engine was held after their first tokens, every bad case was sent, a request with a
# temperature of 1e-39 was queued, and the engine let go.
#
# ## 1. Validation in a few plain lines
#
# Most of the table is type and range checking of the body. Here is that part for completions,
# written out: the body must be an object, `prompt` must be there, a handful of fields have a
# type and a range, and five fields that would change the answer are refused. It returns the
# status and the field to blame. It must agree with what the server answered for every case
# it covers (the server names the field in `param`; for a union type such as `prompt`, pydantic
# adds the branch it tried, `prompt.str`).

# %%
RANGES = {"temperature": (0, 2), "top_p": (0, 1), "n": (1, 16), "logprobs": (0, 20), "seed": (0, 2**64 - 1)}
TYPES = {"max_tokens": int, "n": int, "echo": bool, "temperature": (int, float)}
REFUSED = ("typical_p", "mirostat", "use_beam_search", "length_penalty", "suffix")


def my_check(body):
    if not isinstance(body, dict):
        return 400, None
    if "prompt" not in body:
        return 400, "prompt"
    if not isinstance(body["prompt"], (str, list)):
        return 400, "prompt"
    for name, kind in TYPES.items():
        if name in body and (
            not isinstance(body[name], kind) or isinstance(body[name], bool) and kind is not bool
        ):
            return 400, name
    for name, (lo, hi) in RANGES.items():
        v = body.get(name)
        if v is not None and not (lo < v <= hi if name == "top_p" else lo <= v <= hi):
            return 400, name
    for name in REFUSED:
        if body.get(name):
            return 400, name
    return 200, None


covered = 0
for (what, _, path, body, _, where), r in zip(badinput.CASES, rows):
    if path != badinput.C or not isinstance(body, dict) or where not in ("schema", "unsupported", "accepted"):
        continue
    status, param = my_check(body)
    server_param = r["param"].split(".")[0] or None
    assert (status, param) == (r["status"], server_param), (what, status, param, r)
    covered += 1
print(f"my_check agrees with the server on {covered} cases")

# %% [markdown]
# The rest of the table needs more than the body: the context length, the tokenizer, the model's
# name, the routes, and the body's size before it is read. Those checks live in the server
# (`nanoserve/serve.py`), in the order a request meets them. One more row is left to the engine
# on purpose: the sampling fields the server implements (`min_p`, the penalties, `logit_bias`)
# have their ranges checked by `SamplingParams.validate`, the engine's own check, so the server
# cannot accept a value the engine would refuse (the row `min_p above 1`, under `limits`).
#
# ## 2. The table
#
# Each row: what is wrong, where the server refuses it, the status it should get and got, and
# the error object. `check_statuses` is the day's check: every status as expected, and every
# refusal a sentence of at least ten characters with an error type and no traceback.

# %%
badinput.check_statuses(rows)
for r in rows:
    tag = f"{r['param']}" + (f", {r['code']}" if r["code"] else "")
    print(f"{r['status']} {r['refused_by']:<11} {r['case']:<38} [{tag}] {r['message'][:70]}")
facts = ["case", "route", "refused_by", "expected", "status", "type", "param", "code", "message", "traceback"]
assert [[str(r[k]) for k in facts] for r in rows] == [[r[k] for k in facts] for r in committed("bad-input")]
print("by status:", dict(sorted(Counter(r["status"] for r in rows).items())))

# %% [markdown]
# Three refusals are about size, and each is made before the expensive step. The body over the
# cap gets 413 from `BodyLimit`, middleware that reads the declared `Content-Length` and never
# parses the body. The 50,000-character prompt is refused before it is tokenized: no token of
# SmolLM2's vocabulary stands for more than 162 characters, so no tokenization of it can fit
# 256 tokens. The 300-word prompt has to be tokenized to be judged (301 tokens), and is
# tokenized on a worker thread, off the event loop.
#
# ## 3. The healthy streams beside them
#
# All the bad requests were answered while the engine was held: the loop took no step, and the
# two streams kept their blocks. Then the gate opened, the 200 case and a request with a
# temperature of 1e-39 went in (a value the schema allows that once ended every request of its
# step with a 500; the sampler now treats it as greedy), and the streams finished.

# %%
during, healthy, tiny = run["during"], run["healthy"], run["tiny"]
unchanged = during["blocks_before"] == during["blocks_after"]
print(
    f"while the bad requests were answered: {during['steps']} engine steps; "
    f"the streams' blocks unchanged: {unchanged}"
)
for s, ref in zip(healthy, reference):
    print(f"{s.prompt!r}: {len(s.token_ids)} tokens, finish {s.finish}, equal to alone: {s.token_ids == ref}")
print(f"temperature 1e-39: status {tiny.status}, {len(tiny.token_ids)} tokens, equal to greedy: "
      f"{tiny.token_ids == reference[0]}")  # fmt: skip
print("/health after:", {k: run["health"][k] for k in ("running", "waiting", "kv_blocks_used")})
assert during["steps"] == 0 and during["blocks_before"] == during["blocks_after"] > 0
assert [s.token_ids for s in healthy] == reference and tiny.token_ids == reference[0]
assert run["health"]["kv_blocks_used"] == 0

# %% [markdown]
# ## 4. A server that lets unsupported fields through
#
# The planted server replaces `check_supported` with a function that accepts everything, the
# way a server built on a permissive schema would: the fields are parsed and then nobody reads
# them. Every case is sent again. `check_statuses` catches it, and the rows whose status changed
# are the day's second CSV.

# %%
with contextlib.redirect_stderr(io.StringIO()):
    planted = badinput.planted_table(badinput.make_engine(model, tok))
try:
    badinput.check_statuses(planted)
except AssertionError as err:
    print("planted server -> AssertionError:", str(err)[:160], "...")
else:
    raise AssertionError("check_statuses passed on a server that ignores unsupported fields")
changed = badinput.planted_rows(rows, planted)
for r in changed:
    print(f"  {r['case']:<36} {r['status']} -> {r['planted_status']}")
assert [[str(v) for v in r.values()] for r in changed] == [list(r.values()) for r in committed("planted")]

# %% [markdown]
# Eight requests that asked for something this server cannot do got a 200 and an answer to a
# different question: plain sampling where typical or mirostat sampling was asked for, one
# sample where a beam search was, free text where JSON was asked for, no tool call. A client
# cannot tell from the response. That is why the field is refused rather than ignored, and why
# the refusal lists the other servers' names for such fields too (`ANSWER_CHANGING` in
# `nanoserve/api.py`).
#
# ## 5. The diagram

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
fig.suptitle("Day 40 — bad input: where each request is refused, and a planted server", fontsize=13)
ax = axes[0]
layers = list(dict.fromkeys(r["refused_by"] for r in rows))
statuses = sorted({r["status"] for r in rows})
bottom = [0] * len(layers)
colors = {200: "tab:green", 400: "tab:orange", 404: "tab:purple", 405: "tab:brown", 413: "tab:red"}
for st in statuses:
    counts = [sum(r["refused_by"] == layer and r["status"] == st for r in rows) for layer in layers]
    ax.bar(layers, counts, bottom=bottom, color=colors.get(st, "grey"), label=str(st))
    bottom = [b + c for b, c in zip(bottom, counts)]
for i, b in enumerate(bottom):
    ax.text(i, b + 0.2, str(b), ha="center")
ax.set_ylim(0, max(bottom) + 2)
ax.set_ylabel("requests")
ax.set_title(f"{len(rows)} requests by where they are refused, coloured by status")
ax.tick_params(axis="x", rotation=30)
ax.legend(title="status")

ax = axes[1]
ys = range(len(changed))
ax.barh([y - 0.2 for y in ys], [r["status"] for r in changed], 0.4, color="tab:orange", label="the server")
ax.barh([y + 0.2 for y in ys], [r["planted_status"] for r in changed], 0.4, color="tab:red", label="planted")
ax.set_yticks(list(ys), [r["case"] for r in changed], fontsize=9)
ax.set_xlim(0, 460)
ax.legend(loc="lower right")
ax.set_xlabel("status code")
ax.invert_yaxis()
ax.set_title("the cases a permissive check_supported answers with 200")
fig.tight_layout()
path = diagram_path("day40-bad-input.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %% [markdown]
# ## In the real systems
#
# * **The OpenAI API** answers an invalid request with a 4xx and an `error` object of four
#   fields, `message`, `type` (`invalid_request_error` for a bad request), `param` and `code`.
#   Ours has the same four, which is what lets the official `openai` client raise
#   `openai.BadRequestError` carrying the server's sentence.
# * **vLLM** keeps its request schema as pydantic models (`CompletionRequest`,
#   `ChatCompletionRequest`) in its OpenAI `protocol.py`, and answers errors with an
#   `ErrorResponse` whose `ErrorInfo` has `message`, `type`, `param` and `code`, the same shape.
#   Its base class `OpenAIBaseModel` is declared with `extra="allow"`: a field it does not know
#   is kept and logged as "present in the request but ignored", not refused, so a field the
#   running version no longer implements gets an answer without it and a 200: the case our
#   `check_supported` and `ANSWER_CHANGING` exist to refuse.
# * **TGI** validates in its router before a request is queued (the `validation` module of
#   the Rust router), against limits such as the longest input and the most new tokens the
#   deployment was started with, so a request the model cannot serve never takes a place in
#   the batch; the same order as ours: refuse at the door, then queue.
#
# ## Try it
#
# 1. **Add a case.** Append `("top_k below -1", "POST", badinput.C, {"prompt": "hi", "top_k": -2}, 400,
#    "schema")` to `badinput.CASES` and rerun section 2. The check: its row says 400 with
#    `param` `top_k`, and `my_check` needs one more line in `RANGES` to agree.
# 2. **Break the body cap.** Build the app with `max_body_bytes=10**9` in `poisoned_run` and send
#    the over-the-cap case again. The check: it now gets 400 for its prompt's length instead of
#    413, and `check_statuses` names it.
# 3. **Accept one field, refuse another.** Put `"metadata": {"a": "b"}` in the harmless case's
#    body (the one with `"user"`) and rerun the notebook: its row must still say 200, since
#    `metadata` is not a key of `nanoserve.api.ANSWER_CHANGING`. Then add `"typical_p": 0.5` and
#    change the case's expected status to 400 and its kind to `"unsupported"`: the check is that
#    `check_statuses` passes and the row's `param` is `typical_p`, as `my_check` says too.
