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
# # Day 39 — Cancellation and disconnects
#
# A client can go away at any point of its answer: someone presses stop, a script is killed, a
# proxy's timeout fires, a load tester reaches its deadline. Nothing in HTTP tells the engine.
# Its request is still a row of the batch, still holds KV blocks, and the next step computes
# one more token for it, and the step after that, until `max_tokens`. In a server that only
# writes to a dead socket, such a request costs the same as a live one, and the blocks it
# holds are blocks a waiting request cannot get.
#
# There are two halves to the fix. The engine needs a way to end a request wherever it is,
# `Engine.abort`, which hands its blocks back before it returns. The server has to notice that
# the client is gone and call it. Noticing is the harder half: under Starlette a handler only
# learns of a closed connection when a write to it fails, and a request still queued, or still
# waiting for its next token, writes nothing. `nanoserve/responses.py` therefore runs every
# response next to a listener for the ASGI `http.disconnect` message, and the first of the two
# to finish cancels the other.
#
# Everything below is measured at exact steps: a `Pacer` (the day's script) wraps
# `Engine.step`, so the engine loop takes a step only when the notebook lets it, and the leaver
# leaves at the same step on every run.
#
# 1. `Engine.abort` in the engine alone, against two plain lines of our own,
# 2. three streams through the server, one of which leaves: `/health` before, during and after,
#    and the other two against a run without the leaver,
# 3. a planted server whose abort never reaches the engine, and the check that catches it,
# 4. the day's table (`days/day39/disconnects.py`): both servers, a stream that leaves and a
#    non-streaming client that gives up while queued,
# 5. the diagram.

# %%
import contextlib
import io
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve.bench import cpu_line
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day39"))
import disconnects  # the day's script: its engine, its pacer, its clients and its table

torch.set_num_threads(1)
print(cpu_line())
tok = Tokenizer.from_dir(fetch_default_model())
model = disconnects.tiny_model(tok.vocab_size)
print(
    f"tiny Llama: {model.cfg.num_layers} layers, hidden {model.cfg.hidden_size}, "
    f"vocab {model.cfg.vocab_size:,}"
)
STAY, LEAVER = disconnects.STAY, disconnects.LEAVER
reference = disconnects.alone(disconnects.make_engine(model, tok), STAY, 32)
for p, t in zip(STAY, reference):
    print(f"alone: {p!r} -> {len(t)} tokens, {tok.decode(t)[:40]!r}...")

# %% [markdown]
# The model is the course's tiny random-weight Llama (2 layers, hidden 64) with its vocabulary
# widened to SmolLM2's, so SmolLM2's tokenizer reads its prompts and turns its tokens into text.
# The text is noise, but it is text, and the streams carry it chunk by chunk as they would for a
# trained model. `alone` is the engine's own greedy answer for the two clients that will stay,
# with nobody else in the batch: the reference every later run is held to.
#
# ## 1. `Engine.abort`, in the engine alone
#
# Three requests, nine steps, then C goes. Ending a request is two lines: forget it, and tell
# the scheduler it finished with reason "abort". The scheduler's `finish` takes it out of the
# running list (or the waiting queue), frees its blocks through the allocator and lets the
# runner release its slot-table row. Below, our two lines on one engine and `Engine.abort` on a
# twin; both must leave the same blocks in use and let A and B finish with the tokens they had
# alone.


# %%
def my_abort(engine, request_id):
    req = engine.requests.pop(request_id)
    engine.scheduler.finish(req.seq, "abort")


params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (32, 32, 200)]
twins = []
for abort in (my_abort, lambda e, rid: e.abort(rid)):
    e = disconnects.make_engine(model, tok)
    a, b, c = (e.add_request(p, sp) for p, sp in zip((*STAY, LEAVER), params))
    for _ in range(9):
        e.step()
    blocks = {r: len(e.requests[r].seq.block_table.blocks) for r in (a, b, c)}
    before = e.allocator.num_used
    abort(e, c)
    twins.append((e, a, b, before, blocks))
    print(
        f"{'ours' if abort is my_abort else 'Engine.abort'}: blocks {blocks} -> in use {before} before, "
        f"{e.allocator.num_used} after; running {[s.request_id for s in e.scheduler.running]}"
    )
(e1, a1, b1, used1, _), (e2, a2, b2, used2, blocks2) = twins
assert e1.allocator.num_used == e2.allocator.num_used == used2 - blocks2["req-2"]
outs = {}
for e in (e1, e2):
    got = {}
    while e.has_unfinished():
        for out in e.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    e.allocator.check_invariants([])
    outs[e] = got
print("an abort of a finished request:", e2.abort("req-2"))
assert [reference[0][9:], reference[1][9:]] == [outs[e1]["req-0"], outs[e1]["req-1"]]
assert outs[e1] == outs[e2] and "req-2" not in outs[e2] and e2.allocator.num_used == 0
print("after the abort, A and B finish with their tokens alone, on both engines")

# %% [markdown]
# `Engine.abort` returns False for an id it does not hold, so an abort that arrives after the
# request finished on its own, which happens whenever a client leaves in the last step, is
# harmless. Nothing else is needed in the engine. The rest is the server's job: calling it.
#
# ## 2. Through the server: the stream that leaves
#
# `disconnects.run_server` boots `create_app(engine)` on a free loopback port and sends three
# greedy completions through httpx, all streaming with `return_token_ids`: A and B ask for 32
# tokens and read them all, C asks for 200 and closes its connection as soon as it has 8. The
# pacer takes one step at a time until C has left, holds the engine, and waits for the server
# to call `EngineLoop.abort` (the run records each call). Then `/health` is read at five
# moments: before anything, the moment C left, one step later, when A and B are done, and at
# the end.
#
# How the handler noticed: the response is an `EventStream`. Its `__call__` starts the body
# (the generator that writes events) and, beside it, `listen_for_disconnect`, which waits on
# the ASGI `receive()` for `http.disconnect`. When C's socket closes, uvicorn delivers that
# message, the listener returns and cancels the body, and the generator's `finally` calls
# `abort_all`. No write is needed, which is why it happened while the engine was held and no
# token was on its way.

# %%
with contextlib.redirect_stderr(io.StringIO()) as log:  # uvicorn's own log lines stay out of the outputs
    run = disconnects.one_run(model, tok, aborts=True, streaming=True)
print("boot line:", [ln for ln in log.getvalue().splitlines() if ln.startswith("nanoserve:")][0])
for moment, h in run["health"].items():
    print(f"/health {moment:>15}: {h}")
c = run["c"]
print(f"C read {len(c.token_ids)} tokens ({c.text[:24]!r}...) and left after step {run['left_step']}; "
      f"finish_reason seen: {c.finish}")  # fmt: skip
print("abort calls:", [rid[:5] + "…" + rid[-4:] for rid, _ in run["calls"]])
print(
    f"steps that still carried C after it left: "
    f"{[t['step'] for t in run['trace'] if t['step'] > run['left_step'] and 'C' in t['held']]}"
)
disconnects.check_freed(run["trace"], run["left_step"], within=1)
assert [run["a"].token_ids, run["b"].token_ids] == reference and run["a"].finish == run[
    "b"
].finish == "length"
h = run["health"]
assert h["before"]["kv_blocks_used"] == 0 == h["after"]["kv_blocks_used"]
assert h["at the leave"]["running"] == 3 and h["one step later"]["running"] == 2
assert h["one step later"]["kv_blocks_used"] == h["at the leave"]["kv_blocks_used"] - run["c_blocks_then"]
print("check_freed passes; A and B got exactly their tokens alone")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"from C's close to the handler's abort call: {1000 * (run['calls'][0][1] - c.left_at):.1f} ms")

# %% [markdown]
# Read the five rows together. Before: nothing in use. At the leave: three requests running and
# C's block still counted, because the engine was held and nothing had run since the abort was
# queued. The loop takes its inbox before each step, and a step was already waiting to run when
# the abort came in; that step ran with C in it, so C got one more token that nobody read, and
# then the loop drained the abort and the block went back. One step later: two running, and the
# blocks in use are the earlier count minus C's. The engine's final step counts and the `made`
# totals are in `run["trace"]`; the diagram draws them.
#
# ## 3. A server that never aborts
#
# The same run, with `EngineLoop.abort` replaced by a function that records the call and drops
# it. The handler notices exactly as before (the call is recorded), but the engine never hears
# of it: this is the server as it would be with the listener and no abort, or with an abort that
# went to the wrong id. C keeps its row and its blocks, and the engine keeps computing its
# tokens up to its `max_tokens` of 200. `check_freed` is the check: C must be out of the engine
# within one step of the step it left after.

# %%
with contextlib.redirect_stderr(io.StringIO()):
    leak = disconnects.one_run(model, tok, aborts=False, streaming=True)
for moment, h in leak["health"].items():
    print(f"/health {moment:>15}: {h}")
print("abort calls recorded (and dropped):", len(leak["calls"]))
assert [leak["a"].token_ids, leak["b"].token_ids] == reference
try:
    disconnects.check_freed(leak["trace"], leak["left_step"], within=1)
except AssertionError as err:
    print("planted server -> AssertionError:", err)
else:
    raise AssertionError("check_freed passed on a server that never aborts")
made = leak["trace"][-1]["made"]
print(
    f"tokens made for C: {made['C']} (it read {len(leak['c'].token_ids)}); "
    f"for A and B: {made['A']}, {made['B']}"
)
assert leak["health"]["A and B done"]["running"] == 1 and made["C"] == 200

# %% [markdown]
# A and B still got their tokens: a leaked request harms the others through capacity, not
# through their answers. When A and B were done, `/health` said one request running and 3
# blocks in use, with no client connected at all; the engine went on to make 192 more tokens
# for C after it left, each one a decode row of a batch. With 32 blocks in the pool, a few
# dozen such leavers would hold the whole pool for work nobody reads.
#
# ## 4. The table: both servers, two kinds of leaver
#
# The second leaver does not stream. Its engine has two rows, so C waits in the scheduler's
# queue behind A and B, and its httpx client gives up after 0.5 s, before it ever ran. The
# response is a `WhenDone`: it computes the JSON answer while listening for `http.disconnect`,
# and a client that leaves first cancels the computation and calls `on_disconnect`, which
# aborts. An aborted request that was still queued is simply taken out of the queue: it never
# costs a token. The two streaming runs above are reused; `table` makes the other two.

# %%
with contextlib.redirect_stderr(io.StringIO()):
    rows, runs = disconnects.table(
        model, tok, runs={(True, True): run, (False, True): leak}, reference=reference
    )
facts = ["server", "leaver", "left_after_step", "tokens_when_left", "blocks_when_left", "steps_after_leaving",
         "tokens_after_leaving", "block_steps_after_leaving", "blocks_used_when_others_done",
         "others_equal_alone"]  # fmt: skip
for r in rows:
    print("  ".join(f"{k}={r[k]}" for k in facts))
committed = read_csv(REPO / "days" / "day39" / "day-39-disconnects.csv")  # the journal's table
assert [[str(r[k]) for k in facts] for r in rows] == [[r[k] for k in facts] for r in committed]
assert all(r["others_equal_alone"] == "yes" for r in rows)

# %% [markdown]
# The aborting server paid one token in the streaming case (the step that was already waiting)
# and none in the queued case; the planted one paid 192 and 200 tokens and 1,391 and 1,399
# block-steps (a block held for one step counts one). The queued leaver cost the planted server
# more than the streaming one although it never read a token: nothing of its answer was ever
# going to be read, and it ran to the end once A and B made room.
#
# ## 5. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9))
fig.suptitle("Day 39 — a client leaves: the aborting server against the planted one (tiny Llama, CPU)",
             fontsize=13)  # fmt: skip
for ax, (name, r) in zip(axes[0], (("aborts", run), ("never aborts (planted)", leak))):
    steps = [t["step"] for t in r["trace"]]
    for who, color in (("A", "tab:blue"), ("B", "tab:green"), ("C", "tab:red")):
        ax.step(
            steps,
            [t["held"].get(who, 0) for t in r["trace"]],
            where="post",
            color=color,
            label=f"{who}'s blocks",
        )
    ax.step(
        steps,
        [t["used"] for t in r["trace"]],
        where="post",
        color="k",
        lw=2,
        alpha=0.4,
        label="in use (pool)",
    )
    top = max(t["used"] for t in r["trace"])
    ax.set_ylim(-0.3, 1.45 * top)  # headroom: the legend is one row above the data
    ax.axvline(r["left_step"], color="tab:red", ls="--", lw=1)
    ax.text(r["left_step"] + 1, 1.1 * top, "C leaves", color="tab:red")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    ax.set_title(f"streaming leaver, server that {name}")
    ax.legend(loc="upper center", ncol=4, fontsize=9, frameon=False)

ax = axes[1, 0]
labels = [f"{r['server'].split(' (')[0]}\n{r['leaver'].split(',')[0]}" for r in rows]
x = range(len(rows))
ax.bar(
    [i - 0.2 for i in x], [r["tokens_after_leaving"] for r in rows], 0.4, label="tokens made after leaving"
)
ax.bar(
    [i + 0.2 for i in x], [r["block_steps_after_leaving"] for r in rows], 0.4, label="block-steps held after"
)
for i, r in enumerate(rows):
    ax.text(
        i - 0.2,
        r["tokens_after_leaving"] * 1.15 + 0.6,
        str(r["tokens_after_leaving"]),
        ha="center",
        fontsize=9,
    )
    steps_held = r["block_steps_after_leaving"]
    ax.text(i + 0.2, steps_held * 1.15 + 0.6, str(steps_held), ha="center", fontsize=9)
ax.set_yscale("symlog", linthresh=1)
ax.set_xticks(list(x), labels, fontsize=9)
ax.set_ylim(0, 8000)
ax.set_title("what a leaver cost after it left (day-39-disconnects.csv)")
ax.legend(loc="upper left", fontsize=9)

ax = axes[1, 1]
moments = list(run["health"])
for k, (r, name, color) in enumerate(
    ((run, "aborts", "tab:blue"), (leak, "never aborts (planted)", "tab:red"))
):
    xs = [i + (k - 0.5) * 0.4 for i in range(len(moments))]
    used = [r["health"][m]["kv_blocks_used"] for m in moments]
    ax.bar(xs, used, 0.4, color=color, label=f"{name}: kv_blocks_used")
    for xi, m, u in zip(xs, moments, used):
        ax.text(xi, u + 0.05, f"{r['health'][m]['running']} run", ha="center", fontsize=8)
ax.set_xticks(range(len(moments)), moments, fontsize=9)
ax.set_ylabel("KV blocks in use")
ax.set_ylim(0, 4.2)
ax.set_title("/health at five moments, streaming leaver (label: requests running)")
ax.legend(fontsize=9, loc="upper left")
fig.tight_layout()
path = diagram_path("day39-disconnects.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM.** In the v1 engine, `AsyncLLM.generate` (`vllm/v1/engine/async_llm.py`) is the
#   async generator the OpenAI handlers consume. When the handler's task is cancelled, because
#   the client left, the generator sees `asyncio.CancelledError` (or `GeneratorExit`) and calls
#   `self.abort(request_id, internal=True)`, which reaches the output processor and the
#   `EngineCore` in its own process, where the scheduler ends the request with
#   `finish_requests(..., RequestStatus.FINISHED_ABORTED)` and frees its blocks. The listening
#   is done in `vllm/entrypoints/utils.py`: its `with_cancellation` decorator runs the route
#   handler beside `listen_for_disconnect`, a loop over `request.receive()` that returns on
#   `http.disconnect`, and cancels the handler if the listener wins. That is the race our
#   `WhenDone` and `EventStream` run.
# * **SGLang.** The `TokenizerManager` (`python/sglang/srt/managers/tokenizer_manager.py`)
#   waits for each request's output with a timeout, and on each timeout asks
#   `await request.is_disconnected()`; if the client is gone it calls `abort_request`, which
#   sends an `AbortReq` to the scheduler process. A streaming response also carries a
#   background task from `create_abort_task` that aborts the request once the response is over.
#   So a request that writes nothing is noticed at the next poll, seconds later, rather than at
#   once.
# * **llama.cpp.** `llama-server` hands each completion handler the HTTP request's
#   `is_connection_closed` check; while it waits for results it tests it, and a closed
#   connection makes it post a `SERVER_TASK_TYPE_CANCEL` task to the server queue, which stops
#   the slot's generation and frees the slot for the next request.
#
# All three free at a step boundary, as ours does: a step already running finishes with the
# leaver in it. Where they differ is how the disconnect is seen (a listener racing the handler,
# a poll on a timeout, a check between results) and so how long a request that writes nothing,
# queued or in a long prefill, can go unnoticed.
#
# ## Try it
#
# 1. **Leave later.** `disconnects.one_run(model, tok, True, True, leave_after=40)`. Predict
#    `blocks_when_left` from C's prompt length and 40 tokens (blocks of 16), and check that
#    `steps_after_leaving` is still 1 and A and B still equal `reference`.
# 2. **Break the abort another way.** In `my_abort`, pop the request but skip
#    `scheduler.finish`. The check: section 1 prints `in use 3 before, 3 after` for ours, with
#    `req-2` still in the running list (its sequence is still in `scheduler.running`), and the
#    assert under the print, that both engines hold the same blocks, fails.
# 3. **Two leavers at once.** Add a second leaver to `run_server` (a copy of C with another
#    prompt) and leave both after 8 tokens. The check: `check_freed` passes for both names and
#    `/health` one step later shows 2 running.
