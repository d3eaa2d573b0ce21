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
# # Day 34 — The engine API
#
# Phase 3 ended with a scheduler, paged rows and continuous batching, all driven from inside
# the day scripts by code that reached into the engine's parts. A server cannot work that way.
# It receives requests one at a time, at moments it does not choose, and it has to hand each
# client its tokens as they are made, not at the end. So before there is any HTTP, the engine
# gets a small surface of its own, four calls wide:
#
# * `add_request(prompt, params)` checks a request, queues it and returns its id;
# * `step()` runs one scheduler batch through the model and the sampler and returns a list of
#   `RequestOutput`s: for each request that got something this step, its new token ids, its new
#   text, and a finish reason once it is done;
# * `abort(request_id)` ends a request wherever it is and frees its blocks before it returns;
# * `generate(prompts, params)` is the offline loop over those three, for a batch job.
#
# Everything a server will do on top (Day 35 on) is a loop around `step()`. Today that loop is
# written by hand, so every part of what a step hands back is seen once.
#
# 1. `add_request`: the id it returns, and the requests it refuses before anything is queued,
# 2. `step()` by hand: three requests and a fourth that arrives late, step by step,
# 3. `abort` in the middle of a run, and the blocks it gives back,
# 4. the finish reasons: `length` from `max_tokens` and from the context, `stop`, `abort`,
# 5. `generate` against the hand-driven loop and against the plain greedy loop of days 8-11,
# 6. a wrong loop that drops the outputs of the step that ends the run, caught,
# 7. the day's benchmark (`days/day34/engineapi.py`): the engine against one request at a time,
# 8. the diagram.

# %%
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, describe, diagram_path, read_csv, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams

sys.path.insert(0, str(REPO / "days" / "day34"))
import engineapi  # the day's script: the notebook drives its engine and reads its tables

torch.set_num_threads(1)  # the tiny model's ops are too small to split, and the machine is shared
print(cpu_line())
tiny = tiny_llama(0)
engine = engineapi.make_engine(tiny)
print(f"tiny Llama: vocab {tiny.cfg.vocab_size}, context {engine.max_model_len}, no tokenizer")
cfg = engine.config
print(f"engine: {cfg.max_batch} rows, {engine.pool.num_blocks} blocks of {cfg.block_size} tokens")
print(describe(34))

# %% [markdown]
# `make_engine` builds the engine as it stands today, `engine_config(34, ...)`: the last line
# of each variant above says which day chose it. A step is all prefill or all decode (day 26's
# policy), attention reads the paged pool by gathering (day 18), and admission keeps day 28's
# reserve.
#
# The tiny model has random weights and no tokenizer, so its prompts are lists of token ids and
# its outputs carry no text (`text_delta` stays empty); everything else about the API is the
# same as with SmolLM2. Decoding is greedy (`SamplingParams`' default temperature is 0), so
# every token below is the same on every run.
#
# ## 1. `add_request`
#
# A request is checked when it is added, and a request that cannot run is refused there with a
# `ValueError` that says what to change. A refusal queues nothing and touches nothing in
# flight, which is what a server will need: one client's bad request must not disturb the
# others.

# %%
rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
print("queued:", rid, "| waiting", len(engine.scheduler.waiting), "| blocks used", engine.allocator.num_used)
bad = {
    "an empty prompt": ([], SamplingParams()),
    "a token outside the vocabulary": ([5, 300], SamplingParams()),
    "a prompt as long as the context": (list(range(128)), SamplingParams()),
    "max_tokens 0": ([1, 2], SamplingParams(max_tokens=0)),
    "a negative temperature": ([1, 2], SamplingParams(temperature=-1.0)),
}
for what, (prompt, params) in bad.items():
    try:
        engine.add_request(prompt, params)
        raise AssertionError(f"{what} was accepted")
    except ValueError as e:
        print(f"{what:>32}: {e}")
try:
    engine.add_request([4], request_id=rid)
except ValueError as e:
    print(f"{'the same id twice':>32}: {e}")
assert len(engine.scheduler.waiting) == 1 and engine.allocator.num_used == 0
assert engine.abort(rid) and not engine.has_unfinished()

# %% [markdown]
# The refusals left the one queued request alone; aborting it empties the engine again.
#
# ## 2. `step()` by hand
#
# Three requests are queued before the first step, with prompts of 5, 3 and 9 tokens and
# `max_tokens` of 3, 6 and 4. A fourth, named `late`, is added after two steps, the way a
# request reaches a server while others are running. The loop is the whole of a server's
# engine side: step, hand each output to its request, repeat while `has_unfinished()`.

# %%
engine = engineapi.make_engine(tiny)
for prompt, n in engineapi.HAND:
    print(engine.add_request(prompt, SamplingParams(max_tokens=n)), f"prompt {len(prompt)}, max_tokens {n}")
mine, tokens, t = [], {}, 0
while engine.has_unfinished() and t <= engineapi.ABORT_AT:
    if t == engineapi.ADD_AT:
        engine.add_request(engineapi.LATE[0], SamplingParams(max_tokens=engineapi.LATE[1]), request_id="late")
    outs = engine.step()
    for o in outs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    mine.append(outs)
    print(f"step {t}: " + " | ".join(f"{o.request_id} {o.new_token_ids} {o.finish_reason}" for o in outs)
          + f"  -> running {len(engine.scheduler.running)}, blocks {engine.allocator.num_used}")  # fmt: skip
    t += 1
print("one output:", mine[2][0])

# %% [markdown]
# What a step hands back, read off the lines above:
#
# * one `RequestOutput` per request that sampled a token in that step, and none for a request
#   that did not: a step returns only news;
# * each output carries exactly one new token here, because every prompt fitted in one step's
#   budget and so every row of every step ends in a sampled token (a prompt longer than the
#   budget would be computed over several steps, Day 30, and say nothing until its last chunk);
# * the step that computes a prompt also samples its first token: `late`, added after step 1,
#   has its first token in step 2. That step is `late`'s alone: today's scheduler makes a step
#   all prefill or all decode, prompts first, so the three running requests wait one step and
#   take their third tokens in step 3, beside `late`'s second;
# * `finish_reason` is `None` while a request runs and says why on the output that carries its
#   last token, in the same step: `req-0` ends in step 3 with its third token, `req-2` in step
#   4 with its fourth. Its blocks are free by the time `step()` returns, which is why the blocks
#   used fall from 7 to 4 in step 4 while `late` keeps growing.
#
# ## 3. `abort` in the middle
#
# `late` asked for 20 tokens and has 3. It is aborted between steps, as a server does when its
# client goes away. `abort` returns `True` for a request it knows and `False` after, and the
# blocks are back on the free list when it returns. No later step mentions `late`: an abort is
# the caller's own decision, so the engine reports nothing back for it.

# %%
held = engine.allocator.num_used
late_blocks = len(next(s for s in engine.scheduler.running if s.request_id == "late").block_table.blocks)
print(f"before: running {[s.request_id for s in engine.scheduler.running]}, blocks used {held}, "
      f"late holds {late_blocks}")
print("abort('late'):", engine.abort("late"), "| again:", engine.abort("late"))
print(f"after:  running {[s.request_id for s in engine.scheduler.running]}, "
      f"blocks used {engine.allocator.num_used}")
assert engine.allocator.num_used == held - late_blocks
while engine.has_unfinished():
    outs = engine.step()
    for o in outs:
        tokens[o.request_id] += o.new_token_ids
    mine.append(outs)
    print(f"step {t}: " + " | ".join(f"{o.request_id} {o.new_token_ids} {o.finish_reason}" for o in outs))
    t += 1
print("tokens:", tokens)
print("blocks used at the end:", engine.allocator.num_used, "of", engine.allocator.num_blocks)
assert engine.allocator.num_used == 0 and all("late" not in [o.request_id for o in s] for s in mine[5:])

# %% [markdown]
# The script's `hand_run` does the same run and writes it down step by step
# (`day-34-steps.csv`, the journal's table). The notebook's trace must be the script's:

# %%
rows, script_tokens, finish = engineapi.hand_run(engineapi.make_engine(tiny))
assert [r["outputs"] for r in rows] == [" ".join(o.request_id for o in s) for s in mine]
assert script_tokens == tokens
assert as_text(rows) == read_csv(engineapi.CSV_STEPS)
cols = ["step", "event", "outputs", "new_tokens", "finished", "running", "blocks_used"]
for r in rows:
    print(" | ".join(f"{r[c]}" for c in cols))
print("finish reasons:", finish)

# %% [markdown]
# ## 4. The finish reasons
#
# Four ways to end, and which output says so:
#
# * `length`: the request reached its `max_tokens` (all three above), or the context ran out
#   first: `add_request` cuts `max_tokens` to what the context leaves after the prompt;
# * `stop`: an end-of-sequence token, or a stop string (which needs text, so a tokenizer). The
#   tiny model has no tokenizer and so no end-of-sequence id; below the engine is told one, the
#   token `req-1` produces second, as a real tokenizer's `eos_ids` would;
# * `abort`: set on the sequence by `abort`; no output carries it;
# * `error`: one request that could not be sampled or detokenized ends alone (Day 40).

# %%
short = engineapi.make_engine(tiny, max_model_len=8)
rid = short.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=10))
outs = [o for _ in range(10) for o in short.step()]
got = sum(len(o.new_token_ids) for o in outs)
print(f"context 8, prompt 5, max_tokens 10: {outs[-1].finish_reason} after {got} tokens")
assert [o.finish_reason for o in outs if o.finished] == ["length"] and got == 8 - 5

eos = tokens["req-1"][1]
for ignore in (False, True):
    e = engineapi.make_engine(tiny)
    e.eos_ids = frozenset({eos})
    params = SamplingParams(max_tokens=6, ignore_eos=ignore)
    out = e.generate([engineapi.HAND[1][0]], params, use_tqdm=False)[0]
    print(f"end-of-sequence id {eos}, ignore_eos={ignore}: {out.finish_reason}, tokens {out.token_ids}")
assert out.token_ids == tokens["req-1"] and out.finish_reason == "length"

# %% [markdown]
# The end-of-sequence token is kept as the request's last token, and with `ignore_eos` the
# request runs on past it to its `max_tokens` (a benchmark's setting: every request the same
# length whatever the model says).
#
# ## 5. `generate`, the hand loop, and the plain greedy loop
#
# `generate` queues every prompt, steps until all of them have finished and returns one
# `Completion` per prompt, in the prompts' order. It must give each request exactly the tokens
# the hand-driven loop gave it, and, since decoding is greedy, exactly what the plain loop of
# days 8-11 gives one sequence on a contiguous cache (`generate.greedy_tokens`): batching,
# paging and the order of arrival must change nothing.

# %%
prompts = [p for p, _ in engineapi.HAND]
params = [SamplingParams(max_tokens=n) for _, n in engineapi.HAND]
done = engineapi.make_engine(tiny).generate(prompts, params, use_tqdm=False)
with torch.inference_mode():
    plain = [greedy_tokens(tiny, p, n) for p, n in engineapi.HAND]
for c, ref in zip(done, plain):
    print(f"{c.request_id}: {c.token_ids} {c.finish_reason} | greedy_tokens {ref}")
assert [c.token_ids for c in done] == [tokens[f"req-{i}"] for i in range(3)] == plain
with torch.inference_mode():
    assert tokens["late"] == greedy_tokens(tiny, engineapi.LATE[0], engineapi.LATE[1])[:3]  # until the abort
print("generate == hand loop == greedy_tokens for all three; late's 3 tokens are its first 3 alone")

# %% [markdown]
# ## 6. A wrong loop
#
# The easy mistake in a hand-written loop is to test for the end in the wrong place. The loop
# below checks `has_unfinished()` right after `step()` and leaves before it has looked at what
# that step returned; but the step that finishes the last request is exactly the one that
# returns its last token and its finish reason. A check over the results catches it: every
# request must come back finished, and (with no end-of-sequence id) with `max_tokens` tokens.


# %%
def wrong_loop(engine, reqs):  # wrongly built: drops the outputs of the step that ends the run
    ids = [engine.add_request(p, SamplingParams(max_tokens=n)) for p, n in reqs]
    got = {rid: ([], None) for rid in ids}
    while True:
        outs = engine.step()
        if not engine.has_unfinished():
            break
        for o in outs:
            got[o.request_id] = (got[o.request_id][0] + o.new_token_ids, o.finish_reason)
    return [got[rid] for rid in ids]


def check_complete(results, reqs):
    """Each request finished, with all the tokens it asked for (no end-of-sequence id here)."""
    for i, ((toks, reason), (_, n)) in enumerate(zip(results, reqs)):
        if reason is None or len(toks) != n:
            raise AssertionError(f"request {i}: {len(toks)} of {n} tokens, finish reason {reason}")


check_complete([(c.token_ids, c.finish_reason) for c in done], engineapi.HAND)
print("generate's results pass")
try:
    check_complete(wrong_loop(engineapi.make_engine(tiny), engineapi.HAND), engineapi.HAND)
    raise RuntimeError("the wrong loop went unnoticed")
except AssertionError as e:
    print("wrong loop -> caught:", e)

# %% [markdown]
# Request 1, the longest, lost its sixth token and never heard that it had finished. A server
# built on that loop would leave its client waiting forever for a last chunk that never comes.
#
# ## 7. The engine against one request at a time
#
# What the engine buys over the plain loop is batching: each `step()` is one forward pass for
# every running request, where the plain loop makes one per token per request. On a small
# workload of 8 random requests (the script's `workload`), counted and then timed:

# %%
reqs = engineapi.workload(8, tiny.cfg.vocab_size, seed=1)
small = engineapi.engine_table(tiny, reqs, rows=4, repeats=1)
for r in small:
    print(f"{r['way']:>16}: {r['requests']} requests, {r['tokens']} tokens, "
          f"{r['forward_passes']} forward passes, "
          f"{r['same_as_greedy']} equal to greedy_tokens")  # fmt: skip
assert all(r["same_as_greedy"] == 8 for r in small)

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
for r in small:
    print(f"{r['way']:>16}: {r['seconds'] * 1000:.1f} ms, {r['tok_s']:.1f} tok/s")
print(f"engine against one at a time: {small[0]['seconds'] / small[1]['seconds']:.2f}x")

# %% [markdown]
# The script runs 32 requests (prompts of 4 to 48 tokens, outputs of 4 to 32) on 8 rows, each
# way twice in turn, and writes `day-34-engine.csv`:

# %%
table = read_csv(engineapi.CSV_ENGINE)
facts = ["way", "requests", "rows", "tokens", "forward_passes", "same_as_greedy"]
for r in table:
    print(" | ".join(r[c] for c in facts))
assert all(r["same_as_greedy"] == r["requests"] for r in table)

# %%
# NBVAL_IGNORE_OUTPUT
for r in table:
    print(f"{r['way']:>16}: {r['seconds']} s, {r['tok_s']} tok/s (the script's run)")
print(f"ratio: {float(table[1]['tok_s']) / float(table[0]['tok_s']):.2f}x the tokens a second")

# %% [markdown]
# ## 8. The diagram

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"wspace": 0.3})
fig.suptitle("Day 34 — the engine API, driven by hand (tiny Llama, CPU)", fontsize=13)
names = ["req-0", "req-1", "req-2", "late"]
ax = axes[0]
for y, name in enumerate(names):
    for s, outs in enumerate(mine):
        for o in outs:
            if o.request_id == name:
                ax.scatter(s, y, marker="s", s=300, color="tab:red" if o.finished else "tab:blue")
                ax.text(s, y, str(o.new_token_ids[0]), ha="center", va="center", color="white", fontsize=7)
ax.scatter([engineapi.ABORT_AT + 0.5], [3], marker="x", s=120, color="k", label="abort")
ax.set_yticks(range(len(names)), names)
ax.set_xticks(range(len(mine)))
ax.set_xlabel("step")
ax.set_title("what step() returned: one token each, red = finished")
ax.legend(loc="upper right")
ax.invert_yaxis()

ax = axes[1]
ax.step([r["step"] for r in rows], [r["blocks_used"] for r in rows], where="post", label="blocks used")
ax.step([r["step"] for r in rows], [r["running"] for r in rows], where="post", label="running")
ax.axvline(engineapi.ADD_AT, color="tab:green", ls=":", label="late added")
ax.axvline(engineapi.ABORT_AT, color="k", ls="--", label="late aborted")
ax.set_xlabel("step (after it)")
ax.set_title("what the engine holds after each step")
ax.legend()

ax = axes[2]
ways = [r["way"] for r in table]
ax.bar(ways, [int(r["forward_passes"]) for r in table], color=["tab:gray", "tab:blue"])
ax.set_ylabel("forward passes for the same tokens")
ax2 = ax.twinx()
ax2.plot(ways, [float(r["tok_s"]) for r in table], "ko-")
ax2.set_ylabel("tok/s (the script's run)")
ax.set_title(f"{table[0]['requests']} requests: the engine against one at a time")
path = diagram_path("day34-engine-api.png")
fig.savefig(path, dpi=80, bbox_inches="tight")
plt.close(fig)
display(Image(str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** has the same split. `LLMEngine` (and, in V1, `EngineCore` behind it) offers
#   `add_request(request_id, prompt, params)`, `step()` returning a list of `RequestOutput`s,
#   `abort_request(ids)` and `has_unfinished_requests()`; `LLM.generate` is the offline loop
#   on top, with a tqdm bar, as ours is. Its outputs carry the whole text so far (or only the
#   delta, with `RequestOutputKind.DELTA`), while ours always carry the delta. The server uses
#   `AsyncLLM` instead, which runs `EngineCore` in a process of its own and streams outputs
#   back, so the HTTP side never waits on a forward pass.
# * **SGLang**'s `Engine` (`sglang.Engine(...).generate(...)`) is an offline entry to the same
#   runtime its server uses: the scheduler runs in its own process and a tokenizer manager
#   talks to it; requests are aborted by id there too.
# * **llama.cpp**'s `llama-server` has no separate engine object: a slot per parallel request
#   and one `llama_decode` per loop iteration over all active slots, which is the same step
#   shape written in C++.
# * **TGI** splits it across processes: the Rust router queues and batches, a Python model
#   server runs `prefill` and `decode` calls over gRPC.
#
# ## Try it
#
# 1. Add `late` at step 0 instead of step 2 (`engineapi.ADD_AT = 0`) and rerun `hand_run`. Check
#    that its tokens do not change (`tokens["late"]` against `greedy_tokens`) while the steps'
#    outputs do.
# 2. Call `engine.abort("req-1")` after step 3 of section 2 and check that `allocator.num_used`
#    falls by the length of its block table, and that `generate` on the others is unchanged.
# 3. Break the loop another way: collect only the outputs whose `finish_reason` is `None`.
#    `check_complete` must fail; say which requests it names.
