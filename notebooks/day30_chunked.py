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
# # Day 30 — Chunked prefill
#
# A step has a token budget, `max_num_batched_tokens`: no step computes more tokens than that,
# so no step runs much longer than any other. A prompt longer than the budget therefore cannot
# be computed in one step. The scheduler cuts it into chunks, one a step: each chunk writes its
# K/V into the sequence's blocks, and the next chunk's queries attend over those blocks as if
# the earlier tokens had been computed in the same step. Only the last chunk's logits matter;
# they give the first generated token.
#
# Two things have to be right. The first is arithmetic: chunk k must start exactly where chunk
# k - 1 ended. A position skipped leaves a hole in the cache that every later token attends
# over; a position computed twice wastes budget. Neither is visible in the code that builds one
# chunk, only in the sequence of chunks across steps. The second is what the other requests do
# meanwhile. Under the `budget` policy the streams already decoding keep their one token a step
# and the chunk gets the rest of the budget; under `prefill-first` a step that holds prompt work
# holds nothing else, so the streams wait for every chunk in turn.
#
# 1. one 100-token prompt among three streams, chunk by chunk, under both policies,
# 2. the chunk boundaries in a few lines of our own, equal to the scheduler's at every budget,
# 3. what one chunk computes: its plan, its mask, and its logits against an unchunked prefill,
#    on the tiny model and on SmolLM2,
# 4. the same tokens at every budget and under both policies,
# 5. the streams' gaps, in steps (tiny) and in milliseconds (`days/day30/chunkbench.py` on
#    SmolLM2),
# 6. a chunk boundary off by one, both ways, and what catches it,
# 7. the diagram.

# %%
import csv
import sys
import time

import matplotlib
import matplotlib.ticker
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.bench import cpu_line
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Scheduler
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day30"))
import chunkbench  # the day's script: its workload runner, its gate, and the tables it wrote

torch.set_num_threads(1)
tiny = chunkbench.tiny_model()
REQS = chunkbench.tiny_requests()
STREAMS = ["s0", "s1", "s2"]
print(cpu_line())
print("tiny Llama:", tiny.cfg.num_layers, "layers, hidden", tiny.cfg.hidden_size, "| block size 4")
for rid, ids, n, arrive in REQS:
    print(f"  {rid:>4}: {len(ids):>3} prompt tokens, {n:>2} to generate, arrives before step {arrive}")

# %% [markdown]
# ## 1. One long prompt, chunk by chunk
#
# Three streams with 6-token prompts start at step 0; the 100-token prompt `long` arrives
# before step 5, when all three are decoding. The budget is 16 tokens a step.
# `chunkbench.run_workload` steps the engine and records, for every step, which positions of
# which request it computed: a decode row is the one position `[n - 1, n)` of a sequence of `n`
# tokens, a chunk is `[start, end)` of a prompt.

# %%
runs = {}
for policy in ("budget", "prefill-first"):
    runs[policy] = run = chunkbench.run_workload(chunkbench.tiny_engine(tiny, policy, 16), REQS)
    print(f"{policy}:")
    for i, step in enumerate(run.spans[4:15], start=4):
        decode = [r for r, _, _, k in step if k == "decode"]
        chunks = [f"{r}[{a}, {b})" for r, a, b, k in step if k == "chunk"]
        tokens = sum(b - a for _, a, b, _ in step)
        print(f"   step {i:>2}: {tokens:>2} tokens | decode {decode} | chunks {chunks}")
    print(
        "   long's chunks:",
        chunkbench.sizes(run.chunks("long")),
        "| first token out of step",
        run.token_step["long"][0],
    )
assert chunkbench.sizes(runs["budget"].chunks("long")) == "13x7+9"
assert chunkbench.sizes(runs["prefill-first"].chunks("long")) == "16x6+4"

# %% [markdown]
# Under the budget policy each step gives the three streams their token first, so the chunk
# gets 13 of the 16: seven chunks of 13 and a last one of 9, eight steps, and the streams never
# miss one. Under prefill-first each chunk takes the whole budget, 16 x 6 + 4, seven steps, and
# the streams get nothing in any of them. The long prompt's first token comes out of its last
# chunk's step either way: step 12 against step 11.
#
# ## 2. The boundaries in a few lines
#
# A chunk starts at `num_computed`, the tokens whose K/V is in the cache, and takes what the
# budget leaves: the whole budget under prefill-first, the budget less the step's decode rows
# under the budget policy. The engine sets `num_computed` to the chunk's end once the step has
# run. One more rule, from `Sequence.needs_prefill`: a sequence missing only its newest token is
# a decode row, so if a prompt ever has exactly one token left, that token goes as a decode row.
# The function below takes how many other decode rows each step held and returns the long
# prompt's chunks; it must equal the scheduler's at every budget of the day's table.


# %%
def my_chunks(n_prompt: int, budget: int, decode_rows: list[int], policy: str) -> list[tuple[int, int]]:
    """The chunks [start, end) of one prompt of n_prompt tokens, step by step."""
    chunks, done = [], 0
    for rows in decode_rows:  # the other sequences' decode rows in each step since it arrived
        if done >= n_prompt - 1:  # nothing or only the newest token left: not a chunk any more
            break
        room = budget - rows if policy == "budget" else budget
        end = min(n_prompt, done + room)
        chunks.append((done, end))
        done = end
    return chunks


table, tiny_runs = chunkbench.step_table(tiny)  # every (policy, budget) of the day's CSV
for (policy, budget), run in tiny_runs.items():
    arrive = run.arrived_step["long"]
    rows = [sum(k == "decode" and r != "long" for r, *_, k in step) for step in run.spans[arrive:]]
    mine = my_chunks(100, budget, rows, policy)
    theirs = [(a, b) for _, a, b in run.chunks("long")]
    assert mine == theirs, f"{policy} at {budget}: mine {mine}, the scheduler's {theirs}"
print(f"{len(tiny_runs)} runs: my_chunks equals the scheduler's chunks in every one")
print("budget 8, budget policy:  ", my_chunks(100, 8, [3] * 30, "budget")[:4], "...")
print("budget 8, prefill-first:  ", my_chunks(100, 8, [3] * 30, "prefill-first")[:4], "...")

# %% [markdown]
# ## 3. What one chunk computes
#
# The plan of the step that runs the long prompt's second chunk under the budget policy. Its
# three decode rows come first, one token each, and then the chunk: 13 tokens at positions 13
# to 25, written to the slots its block table gives them, attending over 26 positions. The
# allocator gave the prompt all 25 of its blocks when it was admitted, so the chunk only writes
# into blocks it already owns (slots 49 to 61) and reads through its window the slots its first
# chunk filled (36 to 48) as well.

# %%
eng = chunkbench.tiny_engine(tiny, "budget", 16)
for rid, ids, n, _ in REQS[:3]:
    eng.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
for _ in range(5):
    eng.step()
eng.add_request(REQS[3][1], SamplingParams(max_tokens=6, ignore_eos=True), request_id="long")
eng.step()  # the first chunk, [0, 13)
batch = eng.scheduler.schedule()
plan = eng.runner.plan(batch)
print("chunks (decode rows first):", [(s.request_id, a, b) for s, a, b in batch.as_chunks()])
print("positions:    ", plan.positions.tolist())
print("write_slots:  ", plan.write_slots.tolist())
print("context_lens: ", plan.context_lens.tolist(), "| row_spans:", plan.row_spans)
long_seq = plan.rows[3]
print("long's blocks:", long_seq.block_table.blocks, "| its window:", plan.slot_window[3, :26].tolist())
assert plan.positions[3:].tolist() == list(range(13, 26)) and plan.context_lens[3].item() == 26

# %% [markdown]
# Inside attention, the chunk's 13 queries read the 26 keys through the window, and query `i`,
# at position `13 + i`, may see keys `0 .. 13 + i`. That is the mask `BatchedPagedKVCache`
# builds for a prompt row, `arange(ctx) <= arange(ctx - n, ctx)[:, None]`, and it is the same
# mask an unchunked prefill uses, cut to the chunk's rows. Built from the positions alone:

# %%
start, end, ctx = plan.row_spans[3]
n = end - start
mine = torch.arange(ctx)[None, :] <= plan.positions[start:end][:, None]  # (13, 26)
theirs = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
print("mask", tuple(mine.shape), "| keys each query sees:", mine.sum(1).tolist())
for q in (0, 1, 12):
    print(f"   query at position {13 + q:>2}: " + "".join("x" if v else "." for v in mine[q].tolist()))
assert torch.equal(mine, theirs)

# %% [markdown]
# Chunked prefill in a few lines, on Day 11's contiguous cache: the prompt in pieces, each
# `begin` announcing the positions of the piece, the logits of the last piece's last token.
# Against one prefill of the whole prompt, and against what the engine's own chunked run
# computed (the runner's logits are caught as the long prompt's last chunk comes out):


# %%
def prefill_in_chunks(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits (vocab,) after the last prompt token, the prompt computed `chunk` tokens a call."""
    cache = ContiguousKVCache(model.cfg, len(ids), dtype=model.dtype)
    for s in range(0, len(ids), chunk):
        e = min(len(ids), s + chunk)
        pos = torch.arange(s, e)
        cache.begin(pos)
        logits = model(torch.tensor(ids[s:e]), pos, cache, logits_at=torch.tensor([e - s - 1]))
    return logits[0]


def engine_last_logits(engine, reqs, rid: str):
    """Run reqs through engine; the logits the runner returned for rid's last prompt chunk, and
    the run."""
    execute, caught = engine.runner.execute, {}

    def watched(p):
        out = execute(p)
        for r, (seq, _, end) in enumerate(p.chunks):
            if seq.request_id == rid and end == len(seq.prompt_ids):
                caught["logits"] = out[r].clone()
        return out

    engine.runner.execute = watched
    run = chunkbench.run_workload(engine, reqs)
    return caught["logits"], run


LONG = REQS[3][1]
with torch.inference_mode():
    whole = prefill_in_chunks(tiny, LONG, len(LONG))
    diffs = {c: (prefill_in_chunks(tiny, LONG, c) - whole).abs().max().item() for c in (8, 13, 16, 64)}
    for policy, budget in (("budget", 16), ("prefill-first", 16), ("budget", 128)):
        got, _ = engine_last_logits(chunkbench.tiny_engine(tiny, policy, budget), REQS, "long")
        diffs[f"engine, {policy}, budget {budget}"] = (got - whole).abs().max().item()
for name, d in diffs.items():
    print(f"   chunks of {name}: max |logits - unchunked| {d:.1e}")
assert max(diffs.values()) < 1e-5

# %% [markdown]
# On the AVX2 machine these outputs come from, the chunked prefills on the contiguous cache give
# the unchunked logits bit for bit. An AVX-512 machine differs in the last bits at chunks of 8
# and 13: torch's kernels there add some of the same products in another order when a call has
# fewer rows. Either way it is rounding, far inside the assert's 1e-5.
#
# The same on SmolLM2-135M-Instruct, where a wrong boundary would show in real text: a chat
# prompt of a few dozen tokens, computed in chunks of 16 by the engine at a budget of 16 and in
# one step at the default budget of 512 (that run only as far as its first token), and both
# against the unchunked contiguous prefill.

# %%
MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
smol, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print(f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - t0:.1f} s")
QUESTION = "Why is the sea salty when the rivers that feed it are not? Answer in two short sentences."
IDS = tok.encode_chat([{"role": "user", "content": QUESTION}])
SMOL_REQ = [("q", IDS, 10, 0)]


def smol_engine(budget: int, scheduler_class=Scheduler):
    engine = chunkbench.engine_for(smol, tok, "budget", budget, 16, "16MiB", 256)
    engine.scheduler.__class__ = scheduler_class
    return engine


with torch.inference_mode():
    ref_logits = prefill_in_chunks(smol, IDS, len(IDS))
ref_tokens = greedy_tokens(smol, IDS, 10)
smol_diffs = {}
for budget, reqs in ((16, SMOL_REQ), (512, [("q", IDS, 1, 0)])):  # at 512: the first token only
    logits, run = engine_last_logits(smol_engine(budget), reqs, "q")
    smol_diffs[budget] = (logits - ref_logits).abs().max().item()
    chunkbench.check_chunks_tile(run)
    if budget == 16:
        chunked = run
print(f"{len(IDS)} prompt tokens; at budget 16 the chunks are {chunkbench.sizes(chunked.chunks('q'))}")
for budget, d in smol_diffs.items():
    print(f"   engine at budget {budget:>3}: max |logits - unchunked| {d:.1e}")
same = chunked.tokens["q"] == ref_tokens
print(f"tokens at budget 16 equal to the eager reference: {same} | {tok.decode(ref_tokens)!r}")
assert same and max(smol_diffs.values()) < 1e-3

# %% [markdown]
# In one step the engine's logits are the contiguous prefill's exactly; in chunks of 16 they
# differ by 2.4e-05, which is rounding: the same sums taken over matrices of other shapes
# (Day 32 is about that). The 10 greedy tokens of the chunked run are the eager loop's.

# %% [markdown]
# ## 4. The same tokens at every budget
#
# `chunkbench.step_table` runs the tiny workload under both policies at budgets of 8 to 128
# tokens (128 holds the whole prompt in one step), holds every run to `check_chunks_tile`, and
# asserts that all four requests' greedy tokens equal `greedy_tokens`, the eager one-sequence
# loop. Section 2 already ran it; its rows must be the CSV the script wrote:

# %%
with open(chunkbench.HERE / "day-30-steps.csv") as f:
    steps_csv = list(csv.DictReader(f))
assert [{k: str(v) for k, v in r.items()} for r in table] == steps_csv
cols = [
    "policy",
    "budget",
    "chunks",
    "chunk_sizes",
    "max_gap_steps",
    "stalls",
    "first_token_steps",
    "same_as_eager",
]
print(" | ".join(cols))
for r in table:
    print(" | ".join(str(r[c]) for c in cols))
assert all(r["same_as_eager"] == r["requests"] == 4 for r in table)

# %% [markdown]
# Ten runs, four requests each, every token equal to the eager loop's. The columns that differ
# are the schedule's. `chunks` falls as the budget grows, and so does `first_token_steps`, the
# steps from the long prompt's arrival to its first token. It is larger under the budget policy
# at the same budget (20 against 13 at a budget of 8) because the streams take 3 tokens of
# every step. `max_gap_steps` is the longest wait any stream had between two tokens, counted in
# steps: always 1 under the budget policy, and the number of chunks plus one under
# prefill-first. `stalls` counts the stream-steps with no token (under prefill-first at a budget
# of 8 it also catches the streams waiting for each other's prompts at the start).
#
# ## 5. The gaps in milliseconds
#
# A step is not a unit of time, and this is where the two policies' trade shows. Under the
# budget policy a stream never waits more than one step, but the steps during the long prompt
# are mixed steps, slower than decode steps; under prefill-first it waits several steps, but
# they are prompt steps only. `chunkbench.py` ran SmolLM2 (fp32, one thread): four chat streams
# generating 14 tokens each, a 256-token prompt arriving before step 6, budgets 32, 64, 128 and
# the default 512, which takes the prompt in one step. Every request's tokens were checked
# against `greedy_tokens` and every run against `check_chunks_tile`.

# %%
with open(chunkbench.HERE / "day-30-chunked.csv") as f:
    smol_rows = list(csv.DictReader(f))
with open(chunkbench.HERE / "day-30-trace.csv") as f:
    trace = list(csv.DictReader(f))
cols = ["policy", "budget", "chunk_sizes", "max_gap_steps", "first_token_steps", "same_as_eager"]
print(" | ".join(cols))
for r in smol_rows:
    print(" | ".join(r[c] for c in cols))
for r in smol_rows:
    print(
        f"{r['policy']:>13} {r['budget']:>4}: gap p50 {r['gap_p50_ms']} ms, max {r['gap_max_ms']} ms | "
        f"long prompt's first token {r['ttft_ms']} ms after it arrived | run {r['run_s']} s"
    )
assert all(r["same_as_eager"] == r["requests"] for r in smol_rows)

# %% [markdown]
# The step columns repeat the tiny model's pattern: under the budget policy no stream ever
# waits more than one step, under prefill-first a stream waits the number of chunks plus one.
# The milliseconds show what a step costs. Under the budget policy the streams' longest gap is
# one mixed step, so it grows with the budget: 599.6 ms at 32, 657.4 at 64, 909.9 at 128 and
# 1751.1 at 512, where the whole prompt rides in one step with the four decode rows. Under
# prefill-first the longest gap is the whole prompt's prefill plus a decode step, whatever the
# chunks: 1988.9 to 2709.2 ms, no shorter at a budget of 32 than at 512. At a budget of 32 the
# streams' longest gap is 4.2 times shorter under the budget policy (599.6 against 2531.7 ms).
# Chunking alone does nothing for the streams; chunking with decode rows in every step does.
#
# The price is the long prompt's. Under the budget policy it gets what the streams leave, so a
# smaller budget makes it wait longer: 4305.0 ms to its first token at a budget of 32 against
# 1751.1 ms at 512. The machine was shared with other jobs (load average 4 to 5 on 2 cores)
# while the script ran; each step's time is the fastest of three runs, which removes bursts but
# not a steady load, so a difference of less than about 1.5x between two rows here is not
# something I would defend. The p50 gaps (174.6 to 400.4 ms, all decode or mixed steps of four
# rows) show the size of that noise.

# %% [markdown]
# ## 6. A boundary off by one
#
# Two schedulers built wrong, each in three lines: after a prompt's first chunk, every later
# chunk starts one position late (`SkipsOne`: for the long prompt positions 13, 26, 39, ... are
# never computed, and their slots keep whatever the pool held) or one position early
# (`RepeatsOne`: positions 12, 25, 38, ... are computed twice).
# The engine runs both without complaint. What catches them? Three candidate checks: the greedy
# tokens against the eager loop, the step's token count against the budget, and
# `chunkbench.check_chunks_tile`, which walks every request's spans in step order and requires
# each to start where the last one ended.


# %%
class SkipsOne(Scheduler):
    def _schedule_prefill(self, budget=None, batch=None, admit=True):
        batch = super()._schedule_prefill(budget, batch, admit)
        batch.chunks = [(s, a + 1 if a > 0 else a, b) for s, a, b in batch.chunks]  # should be a
        return batch


class RepeatsOne(Scheduler):
    def _schedule_prefill(self, budget=None, batch=None, admit=True):
        batch = super()._schedule_prefill(budget, batch, admit)
        batch.chunks = [(s, a - 1 if a > 0 else a, b) for s, a, b in batch.chunks]  # should be a
        return batch


eager = {rid: greedy_tokens(tiny, ids, n) for rid, ids, n, _ in REQS}
caught = {}
for variant in (Scheduler, SkipsOne, RepeatsOne):
    wrong = chunkbench.tiny_engine(tiny, "budget", 16)
    wrong.scheduler.__class__ = variant
    run = chunkbench.run_workload(wrong, REQS)
    same = sum(run.tokens[r] == eager[r] for r in eager)
    print(f"{variant.__name__}: long's chunks {[(a, b) for _, a, b in run.chunks('long')][:3]} ...")
    largest = max(run.step_tokens())
    print(f"   tokens equal to the eager loop's: {same} of {len(eager)} | largest step: {largest} tokens")
    try:
        chunkbench.check_chunks_tile(run)
        caught[variant.__name__] = None
        print("   check_chunks_tile: passes")
    except AssertionError as e:
        caught[variant.__name__] = str(e)
        print("   check_chunks_tile caught:", e)
assert caught["Scheduler"] is None and caught["SkipsOne"] and caught["RepeatsOne"]

# %% [markdown]
# On the tiny model neither bug changes a single token, and only the repeat shows in the step
# size (17 tokens against a budget of 16, which a budget check like Day 57's would catch). The
# tile check catches both, at the first sequence whose prompt takes two chunks: here the stream
# `s2`, whose 6-token prompt was split 4 + 2 over steps 0 and 1, before `long` even arrived.
# The tokens say nothing because the tiny model's weights are random and small: a few
# positions of zero keys and values among dozens barely move its logits. SmolLM2's do move:

# %%
for variant in (SkipsOne, RepeatsOne):
    logits, run = engine_last_logits(smol_engine(16, variant), SMOL_REQ, "q")
    d = (logits - ref_logits).abs().max().item()
    same = run.tokens["q"] == ref_tokens
    print(f"{variant.__name__}: max |logits - unchunked| {d:.2e}, tokens equal: {same}")
    print(f"   {tok.decode(run.tokens['q'])!r}")
    if variant is SkipsOne:
        assert not same and d > 1e-2
    else:
        assert same and d < 1e-3

# %% [markdown]
# The skipped positions (16, 32 and 48 of this 50-token prompt) change SmolLM2's answer: the
# last logits move by 6.81 and the reply changes at its tenth token ("source" for "river").
# The repeated ones change nothing: positions 15, 31 and 47 are recomputed from the same inputs
# over the same cache and their K/V written again to the same slots, and the logits differ from
# the unchunked ones by 2.57e-05, as much as a correct chunked run's (2.4e-05). So token
# equality catches one of the two bugs, and only on one of the two models; a budget check
# catches the other; the tile check catches both on both, because it checks the thing itself:
# every position computed once.
#
# ## 7. The diagram

# %%
COLORS = {"decode": "tab:blue", "chunk": "tab:orange"}
fig, axes = plt.subplots(2, 2, figsize=(14, 9.5), gridspec_kw={"hspace": 0.42, "wspace": 0.25})
ax = axes[0][0]
for j, policy in enumerate(("budget", "prefill-first")):
    run = runs[policy]
    x = [i + (j - 0.5) * 0.4 for i in range(len(run.spans))]
    dec = [sum(k == "decode" for *_, k in step) for step in run.spans]
    chk = [sum(b - a for _, a, b, k in step if k == "chunk") for step in run.spans]
    hatch = None if policy == "budget" else "//"
    ax.bar(x, dec, 0.4, color=COLORS["decode"], hatch=hatch, edgecolor="white")
    ax.bar(x, chk, 0.4, bottom=dec, color=COLORS["chunk"], hatch=hatch, edgecolor="white")
ax.axhline(16, color="crimson", lw=1, ls="--")
ax.set_xlim(-0.8, 26)
ax.set_xlabel("step (left bar of each pair: budget policy; right, hatched: prefill-first)")
ax.set_ylabel("tokens in the step")
ax.set_title("tiny model, budget 16: decode rows (blue) and prompt chunks (orange)", fontsize=10)

ax = axes[0][1]
for policy, color in (("budget", "tab:green"), ("prefill-first", "tab:gray")):
    rows = [r for r in table if r["policy"] == policy]
    b = [r["budget"] for r in rows]
    ax.plot(b, [r["max_gap_steps"] for r in rows], "o-", color=color, label=f"{policy}: streams' longest gap")
    ax.plot(
        b, [r["first_token_steps"] for r in rows], "s--", color=color, label=f"{policy}: long prompt's wait"
    )
ax.set_xscale("log", base=2)
ax.set_xticks([8, 16, 32, 64, 128], ["8", "16", "32", "64", "128"])
ax.set_xlabel("max_num_batched_tokens")
ax.set_ylabel("steps")
ax.set_title("tiny model: a 100-token prompt among 3 streams, in steps", fontsize=10)
ax.legend(fontsize=8)

ax = axes[1][0]
for j, policy in enumerate(("budget", "prefill-first")):
    steps = [r for r in trace if r["policy"] == policy and r["budget"] == "64"]
    kind = [
        "mixed"
        if int(r["chunk_tokens"]) and int(r["decode_rows"])
        else "chunk"
        if int(r["chunk_tokens"])
        else "decode"
        for r in steps
    ]
    color = {"decode": "tab:blue", "mixed": "tab:purple", "chunk": "tab:orange"}
    x = [int(r["step"]) + (j - 0.5) * 0.4 for r in steps]
    ax.bar(x, [float(r["step_ms"]) for r in steps], 0.4, color=[color[k] for k in kind],
           hatch=None if policy == "budget" else "//", edgecolor="white")  # fmt: skip
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:purple", "tab:orange")]
ax.legend(handles, ["decode only", "decode rows + chunk", "chunk only"], fontsize=8)
ax.set_xlabel("step (left: budget policy; right, hatched: prefill-first)")
ax.set_ylabel("ms (fastest of 3 runs)")
ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
ax.set_title("SmolLM2, budget 64: each step's time, a 256-token prompt arriving at step 6", fontsize=10)

ax = axes[1][1]
for policy, color in (("budget", "tab:green"), ("prefill-first", "tab:gray")):
    rows = [r for r in smol_rows if r["policy"] == policy]
    b = [int(r["budget"]) for r in rows]
    ax.plot(
        b, [float(r["gap_max_ms"]) for r in rows], "o-", color=color, label=f"{policy}: streams' longest gap"
    )
    ax.plot(
        b,
        [float(r["ttft_ms"]) for r in rows],
        "s--",
        color=color,
        label=f"{policy}: long prompt's first token",
    )
ax.set_xscale("log", base=2)
ax.set_xticks(b, [str(v) for v in b])
ax.set_xlabel("max_num_batched_tokens")
ax.set_ylabel("ms")
ax.set_title("SmolLM2: 4 streams and a 256-token prompt (shared 2-core CPU, 1 thread)", fontsize=10)
ax.legend(fontsize=8)
fig.suptitle("Day 30: a long prompt in chunks, and what the other streams wait", fontsize=13)
out = diagram_path("day30-chunked.png")
fig.savefig(out, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(str(out)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM V1** (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`) has no prefill phase
#   to chunk: every request carries `num_computed_tokens`, and each step gives a request
#   `num_new_tokens`, the tokens it is behind, cut to what is left of the step's
#   `token_budget` (`max_num_batched_tokens`). A prompt that does not fit simply catches up over
#   several steps; that is chunked prefill, always on in V1. `long_prefill_token_threshold`
#   caps one request's share of a step, and `max_num_partial_prefills` how many prompts may be
#   part-way at once. In V0 the same behaviour was a switch, `--enable-chunked-prefill`.
#   Our `num_computed` and the engine setting it to the chunk's end are the same bookkeeping.
# * **vLLM's `--deterministic-prefix-caching`** splits a prompt at its last block boundary so
#   that the tail is always computed with the same number of rows, whether the head came from
#   the cache or not: chunk boundaries change the matrix shapes, and with them the rounding
#   (Day 32 measures that here).
# * **SGLang** sets the chunk size directly, `--chunked-prefill-size` (separate from the step's
#   `--max-prefill-tokens`); a prompt longer than it is prefilled a chunk per forward pass,
#   and `--enable-mixed-chunk` lets the running decode requests share that pass.
# * **TensorRT-LLM** calls it chunked context (`enable_chunked_context`), with a chunk unit
#   tied to its KV block size, inside the per-step `max_num_tokens`.
# * **llama.cpp**'s server feeds a prompt to the model in batches of `-b` / `--batch-size`
#   tokens (and physical micro-batches of `-ub`), and with continuous batching the other slots'
#   decode tokens go into the same batches.
# * **Sarathi-Serve** (Agrawal et al., OSDI 2024) is the paper that made chunked prefill with
#   decodes riding along the standard answer to the stall measured in section 5.

# %% [markdown]
# ## Try it
#
# 1. Give the streams more rows: put a fourth stream in `chunkbench.tiny_requests` and predict
#    the long prompt's chunks at budget 16 under the budget policy before running section 1
#    (12 a step: how many chunks, and the last one's size?). `my_chunks` must still agree.
# 2. Plant the off-by-one in `my_chunks` instead (`chunks.append((done + 1, end))` after the
#    first chunk). The comparison in section 2 should fail and name the first budget it breaks.
# 3. Make `SkipsOne` skip only every other chunk boundary. `check_chunks_tile` should still
#    name the step; does SmolLM2's answer still change?
# 4. Run `python days/day30/chunkbench.py --budgets 16,512 --prompt-len 384` and check in
#    `day-30-chunked.csv` that the budget policy's `gap_max_ms` grows with the budget while
#    prefill-first's stays near the prompt's whole prefill time.
