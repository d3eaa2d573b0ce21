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
# meanwhile. The engine runs as it stands today, `engine_config(30, ...)`: the `prefill-first`
# schedule, where a step that holds prompt work holds nothing else, so the streams already
# decoding wait for every chunk in turn; the gather read of the pool; the model's own linears.
# A step that gives the streams their tokens and the chunk the rest of the budget comes later
# (mixed steps, day 57), and the `Engine` that steps it all is day 34's API.
#
# 1. one 100-token prompt among three streams, chunk by chunk,
# 2. the chunk boundaries in a few lines of our own, equal to the scheduler's at every budget,
# 3. what one chunk computes: its plan, its mask, and its logits against an unchunked prefill,
#    on the tiny model and on SmolLM2,
# 4. the same tokens at every budget,
# 5. the streams' gaps, in steps (tiny) and in milliseconds (`days/day30/chunkbench.py` on
#    SmolLM2),
# 6. a chunk boundary off by one, both ways, and what catches it,
# 7. the diagram.

# %%
import sys
import time

import matplotlib
import matplotlib.ticker
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, read_csv
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
run16 = chunkbench.run_workload(chunkbench.tiny_engine(tiny, "prefill-first", 16), REQS)
for i, step in enumerate(run16.spans[4:15], start=4):
    decode = [r for r, _, _, k in step if k == "decode"]
    chunks = [f"{r}[{a}, {b})" for r, a, b, k in step if k == "chunk"]
    tokens = sum(b - a for _, a, b, _ in step)
    print(f"   step {i:>2}: {tokens:>2} tokens | decode {decode} | chunks {chunks}")
print("long's chunks:", chunkbench.sizes(run16.chunks("long")), "| first token out of step",
      run16.token_step["long"][0])  # fmt: skip
assert chunkbench.sizes(run16.chunks("long")) == "16x6+4"

# %% [markdown]
# Each chunk takes the whole budget, 16 x 6 + 4, seven steps (5 to 11), and the three streams
# get nothing in any of them: a step with prompt work in it is all prompt. The long prompt's
# first token comes out of its last chunk's step, step 11, and from step 12 on it decodes
# beside the streams.
#
# ## 2. The boundaries in a few lines
#
# A chunk starts at `num_computed`, the tokens whose K/V is in the cache, and takes the whole
# budget (the only prompt due here is the long one). The engine sets `num_computed` to the
# chunk's end once the step has run. One more rule, from `Sequence.needs_prefill`: a sequence
# missing only its newest token is a decode row, so if a prompt ever has exactly one token
# left, that token goes as a decode row. The function below returns the long prompt's chunks;
# it must equal the scheduler's at every budget of the day's table.


# %%
def my_chunks(n_prompt: int, budget: int) -> list[tuple[int, int]]:
    """The chunks [start, end) of one prompt of n_prompt tokens, step by step."""
    chunks, done = [], 0
    while done < n_prompt - 1:  # nothing or only the newest token left: not a chunk any more
        end = min(n_prompt, done + budget)
        chunks.append((done, end))
        done = end
    return chunks


table, tiny_runs = chunkbench.step_table(tiny)  # every budget of the day's CSV
for (_, budget), got in tiny_runs.items():
    mine = my_chunks(100, budget)
    theirs = [(a, b) for _, a, b in got.chunks("long")]
    assert mine == theirs, f"at {budget}: mine {mine}, the scheduler's {theirs}"
    assert [i for i, _, _ in got.chunks("long")] == list(range(5, 5 + len(mine)))  # one step after another
print(f"{len(tiny_runs)} runs: my_chunks equals the scheduler's chunks in every one")
print("budget 8:", my_chunks(100, 8)[:4], "...")

# %% [markdown]
# ## 3. What one chunk computes
#
# The plan of the step that runs the long prompt's second chunk. It holds the chunk alone: 16
# tokens at positions 16 to 31, written to the slots its block table gives them, attending over
# 32 positions. The allocator gave the prompt all 25 of its blocks when it was admitted, so the
# chunk only writes into blocks it already owns (slots 52 to 67) and reads through its window
# the slots its first chunk filled (36 to 51) as well.

# %%
eng = chunkbench.tiny_engine(tiny, "prefill-first", 16)
for rid, ids, n, _ in REQS[:3]:
    eng.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
for _ in range(5):
    eng.step()
eng.add_request(REQS[3][1], SamplingParams(max_tokens=6, ignore_eos=True), request_id="long")
eng.step()  # the first chunk, [0, 16)
batch = eng.scheduler.schedule()
plan = eng.runner.plan(batch)
print("chunks:", [(s.request_id, a, b) for s, a, b in batch.as_chunks()])
print("positions:    ", plan.positions.tolist())
print("write_slots:  ", plan.write_slots.tolist())
print("context_lens: ", plan.context_lens.tolist(), "| row_spans:", plan.row_spans)
long_seq = plan.rows[0]
print("long's blocks:", long_seq.block_table.blocks, "| its window:", plan.slot_window[0, :32].tolist())
assert plan.positions.tolist() == list(range(16, 32)) and plan.context_lens[0].item() == 32

# %% [markdown]
# Inside attention, the chunk's 16 queries read the 32 keys through the window, and query `i`,
# at position `16 + i`, may see keys `0 .. 16 + i`. That is the mask `BatchedPagedKVCache`
# builds for a prompt row, `arange(ctx) <= arange(ctx - n, ctx)[:, None]`, and it is the same
# mask an unchunked prefill uses, cut to the chunk's rows. Built from the positions alone:

# %%
start, end, ctx = plan.row_spans[0]
n = end - start
mine = torch.arange(ctx)[None, :] <= plan.positions[start:end][:, None]  # (16, 32)
theirs = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
print("mask", tuple(mine.shape), "| keys each query sees:", mine.sum(1).tolist())
for q in (0, 1, 15):
    print(f"   query at position {16 + q:>2}: " + "".join("x" if v else "." for v in mine[q].tolist()))
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
    for budget in (16, 128):
        got, _ = engine_last_logits(chunkbench.tiny_engine(tiny, "prefill-first", budget), REQS, "long")
        diffs[f"engine, budget {budget}"] = (got - whole).abs().max().item()
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
    engine = chunkbench.engine_for(smol, tok, "prefill-first", budget, 16, "16MiB", 256)
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
# `chunkbench.step_table` runs the tiny workload at budgets of 8 to 128 tokens (128 holds the
# whole prompt in one step), holds every run to `check_chunks_tile`, and
# asserts that all four requests' greedy tokens equal `greedy_tokens`, the eager one-sequence
# loop. Section 2 already ran it; its rows must be the CSV the script wrote:

# %%
assert as_text(table) == read_csv(chunkbench.HERE / "day-30-steps.csv")
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
# Five runs, four requests each, every token equal to the eager loop's. The columns that differ
# are the schedule's. `chunks` falls as the budget grows, and so does `first_token_steps`, the
# steps from the long prompt's arrival to its first token (13 at a budget of 8, 1 at 128).
# `max_gap_steps` is the longest wait any stream had between two tokens, counted in steps: the
# number of chunks plus one, since the streams get nothing while the chunks run (14 at a budget
# of 8, 2 at 128). `stalls` counts the stream-steps with no token (at a budget of 8 it also
# catches the streams waiting for each other's prompts at the start). In steps, a smaller
# budget only makes the streams' wait longer.
#
# ## 5. The gaps in milliseconds
#
# A step is not a unit of time. A smaller budget makes the streams wait more steps, but each of
# those steps carries fewer prompt tokens, so the question is what the wait comes to in
# milliseconds. `chunkbench.py` ran SmolLM2 (fp32, one thread): four chat streams generating 14
# tokens each, a 256-token prompt arriving before step 6, budgets 32, 64, 128 and the default
# 512, which takes the prompt in one step. Every request's tokens were checked
# against `greedy_tokens` and every run against `check_chunks_tile`.

# %%
smol_rows = read_csv(chunkbench.HERE / "day-30-chunked.csv")
trace = read_csv(chunkbench.HERE / "day-30-trace.csv")
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
# The step columns repeat the tiny model's pattern: a stream waits the number of chunks plus
# one. The milliseconds say the same. The streams' longest gap is the whole prompt's prefill
# plus a decode step, and it grew as the chunks shrank: 658.5 ms at 512, where the prompt takes
# one step, 696.5 at 128, 807.2 at 64 and 950.8 at 32. Each chunk is a step, and each step pays
# a fixed cost (the weights read once, the Python around the model). In the trace at a budget
# of 32, a decode step of four rows takes 55.0 to 59.5 ms and each of the long prompt's chunks
# of 32 tokens 106.9 to 115.7 ms, while the whole 256-token prompt in one step, at 512, takes
# 594.1 ms: eight chunks cost more than the one step. The long prompt's own first token
# follows the same way: 594.1 ms at 512 against 881.0 ms at 32. On this engine chunking alone
# does nothing for the streams and costs the newcomer; what it buys is a bound on the step,
# which never carries more than the budget, so no step needs activations for more tokens than
# that. Chunks start paying the streams back only when a step can carry their decode rows
# beside a chunk: the mixed step of day 57.
#
# The machine was quiet while the script ran; each step's time is the fastest of two runs. The
# streams' median gap, one decode step, stayed between 62.2 and 64.7 ms at all four budgets, so
# the spread in the longest gap, 658.5 to 950.8 ms, is the schedule's and not the machine's.
#
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
    wrong = chunkbench.tiny_engine(tiny, "prefill-first", 16)
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
# size (17 tokens against a budget of 16, which a check on each step's size would catch). The
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
dec = [sum(k == "decode" for *_, k in step) for step in run16.spans]
chk = [sum(b - a for _, a, b, k in step if k == "chunk") for step in run16.spans]
ax.bar(range(len(run16.spans)), dec, 0.7, color=COLORS["decode"], edgecolor="white")
ax.bar(range(len(run16.spans)), chk, 0.7, bottom=dec, color=COLORS["chunk"], edgecolor="white")
ax.axhline(16, color="crimson", lw=1, ls="--")
ax.set_xlim(-0.8, 26)
ax.set_xlabel("step (the long prompt arrives before step 5)")
ax.set_ylabel("tokens in the step")
ax.set_title("tiny model, budget 16: decode rows (blue) and prompt chunks (orange)", fontsize=10)

ax = axes[0][1]
b = [r["budget"] for r in table]
ax.plot(b, [r["max_gap_steps"] for r in table], "o-", color="tab:gray", label="streams' longest gap")
ax.plot(b, [r["first_token_steps"] for r in table], "s--", color="tab:green",
        label="long prompt's wait (= its chunks)")  # fmt: skip
ax.set_xscale("log", base=2)
ax.set_xticks([8, 16, 32, 64, 128], ["8", "16", "32", "64", "128"])
ax.set_xlabel("max_num_batched_tokens")
ax.set_ylabel("steps")
ax.set_title("tiny model: a 100-token prompt among 3 streams, in steps", fontsize=10)
ax.legend(fontsize=8)

ax = axes[1][0]
steps = [r for r in trace if r["budget"] == "64"]
kind = ["chunk" if int(r["chunk_tokens"]) else "decode" for r in steps]
ax.bar([int(r["step"]) for r in steps], [float(r["step_ms"]) for r in steps], 0.7,
       color=[COLORS[k] for k in kind], edgecolor="white")  # fmt: skip
handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("decode", "chunk")]
ax.legend(handles, ["decode rows only", "a prompt chunk only"], fontsize=8)
ax.set_xlabel("step")
ax.set_ylabel("ms (fastest of 2 runs)")
ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
ax.set_title("SmolLM2, budget 64: each step's time, a 256-token prompt arriving at step 6", fontsize=10)

ax = axes[1][1]
b = [int(r["budget"]) for r in smol_rows]
ax.plot(b, [float(r["gap_max_ms"]) for r in smol_rows], "o-", color="tab:gray", label="streams' longest gap")
ax.plot(b, [float(r["ttft_ms"]) for r in smol_rows], "s--", color="tab:green",
        label="long prompt's first token")  # fmt: skip
ax.set_xscale("log", base=2)
ax.set_xticks(b, [str(v) for v in b])
ax.set_xlabel("max_num_batched_tokens")
ax.set_ylabel("ms")
ax.set_ylim(0, None)
ax.set_title("SmolLM2: 4 streams and a 256-token prompt (2-core CPU, 1 thread)", fontsize=10)
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
# 1. **A second long prompt.** Append `("long2", chunkbench.tiny_prompt(98, 40), 6, 6)` to the
#    requests and rerun section 1 at a budget of 16. Predict first, step by step, the chunks of
#    both prompts (a prompt already running takes its chunk before anyone new is admitted, and
#    the newcomer gets what the budget has left); then check with `run16.chunks("long2")`, and
#    `chunkbench.check_chunks_tile(run16)` must pass.
# 2. Plant the off-by-one in `my_chunks` instead (`chunks.append((done + 1, end))` after the
#    first chunk). The comparison in section 2 should fail and name the first budget it breaks.
# 3. Make `SkipsOne` skip only every other chunk boundary. `check_chunks_tile` should still
#    name the step; does SmolLM2's answer still change?
