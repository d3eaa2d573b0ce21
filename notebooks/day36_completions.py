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
# # Day 36 — OpenAI-compatible completions
#
# Yesterday's server answered HTTP; today it answers the way clients already expect. Nearly
# every tool that talks to a language model over the network, from the official `openai`
# package to evaluation harnesses and load testers, speaks OpenAI's completions API, so a
# server that takes the same JSON body and returns the same JSON shape can be dropped in
# behind all of them without a line changing on their side. The body is small: a prompt
# (text, token ids, or a list of either), sampling knobs, `max_tokens`, `stop`. The answer is
# a list of `choices`, each with its `text`, an `index` and a `finish_reason`, and a `usage`
# block that counts tokens.
#
# Two fields make the route more than a text box. `logprobs` returns each token's
# log-probability under the model, and `echo` returns the prompt with its own scores. With
# `max_tokens` 0 the server generates nothing and only scores, which is how evaluation
# harnesses ask a model which answer of a multiple-choice question it finds most likely. A
# score is only worth something if it is the model's real log-probability of the right token
# at the right position, so today checks it against log_softmax of the model's own logits,
# computed here, and catches a scorer that is one position off.
#
# 1. the schema: what a request may carry, and one response taken apart (usage, finish reasons,
#    a token-id prompt), every request shape of the day's table sent once,
# 2. `echo` with `logprobs`: the prompt's scores, position by position, against the logits,
# 3. scoring a continuation as a harness does, through the `openai` client, equal to our own
#    sum from the logits,
# 4. the classic off-by-one scorer, caught,
# 5. `n` and `best_of`: several samples of one prompt, and which ones best_of keeps,
# 6. a list of prompts: the choices' indices, and one request against one per option,
# 7. the diagram.

# %%
import json
import sys

import matplotlib
import openai
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve.api import CompletionRequest
from nanoserve.bench import cpu_line
from nanoserve.models import load_model
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day36"))
import completions  # the day's script: the notebook runs its requests and reads its tables

torch.set_num_threads(1)  # the machine is shared; one thread keeps the timings comparable
print(cpu_line())
MODEL_DIR = fetch_default_model()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
engine = completions.make_engine(model, tok)  # engine_config(36, ...): the engine of day 34
server = completions.served(engine)
url = server.__enter__()  # uvicorn on a free port of 127.0.0.1, in a thread; closed at the end
print("serving", completions.HTTP.get(url + "/v1/models").json()["data"][0]["id"], "on http://127.0.0.1:PORT")


def committed(name):
    """A CSV of days/day36/ as the journal's tables read it."""
    return read_csv(REPO / "days" / "day36" / f"day-36-{name}.csv")


# %% [markdown]
# ## 1. The schema, and one response taken apart
#
# `nanoserve.api.CompletionRequest` is OpenAI's request body as a pydantic model, strict about
# types. These are its fields and their defaults (a field the server does not implement, such
# as `suffix` or another server's `typical_p`, is refused when set, never ignored; that is
# Day 40's subject):

# %%
for name, field in CompletionRequest.model_fields.items():
    print(f"  {name:<18} default {field.default!r}")

# %% [markdown]
# `completions.requests_table` sends one request of each shape the day covers and keeps the
# status, the choices' indices and finish reasons, and the server's usage counts. The
# deterministic columns must equal the committed `day-36-requests.csv` (the journal's table).

# %%
rows, bodies = completions.requests_table(url, tok)
facts = ["kind", "status", "choices", "indices", "finish_reasons", "prompt_tokens", "completion_tokens",
         "error_param"]  # fmt: skip
for r in rows:
    print("  ".join(f"{k}={r[k]}" for k in facts))
assert [[str(r[k]) for k in facts] for r in rows] == [[r[k] for k in facts] for r in committed("requests")]
kinds = {r["kind"]: b for r, b in zip(rows, bodies)}

# %% [markdown]
# The first answer whole. `id` is fresh for every request and `created` is the clock, so both
# are masked here; everything else is what any OpenAI client parses. This request asked for
# `return_token_ids` (an extension: the generated ids in each choice), which lets the usage be
# checked against what came back: `prompt_tokens` is the prompt's length under the tokenizer,
# `completion_tokens` the number of ids generated, and the text is their decoding.

# %%
plain = kinds["text prompt"]
shown = plain | {"id": plain["id"][:5] + "…", "created": "…"}
print(json.dumps(shown, indent=1))
choice = plain["choices"][0]
assert plain["object"] == "text_completion" and plain["id"].startswith("cmpl-")
assert plain["usage"]["prompt_tokens"] == len(tok.encode(completions.PROMPT))
assert plain["usage"]["completion_tokens"] == len(choice["token_ids"]) == 4
assert choice["text"] == tok.decode(choice["token_ids"])
assert plain["usage"]["total_tokens"] == plain["usage"]["prompt_tokens"] + plain["usage"]["completion_tokens"]

# %% [markdown]
# Two finish reasons. `length`: the answer ran into `max_tokens` (4 above). `stop`: a stop
# string appeared, or the model produced its end-of-sequence token. With `stop: ["."]` the
# same greedy answer ends at its first full stop, the stop string itself left out of the text,
# and `completion_tokens` counts the tokens actually generated up to it.
#
# A prompt given as token ids skips the tokenizer. It is the same request to the engine, so
# greedy decoding gives the same tokens: asked for 2, it returns the first 2 of the answer
# above, and the same `prompt_tokens`.

# %%
stopped, by_ids = kinds["stop string"], kinds["token-id prompt"]
print("length:", repr(choice["text"]), choice["finish_reason"])
print("stop:  ", repr(stopped["choices"][0]["text"]), stopped["choices"][0]["finish_reason"],
      "| completion_tokens", stopped["usage"]["completion_tokens"])  # fmt: skip
print("ids:   ", tok.encode(completions.PROMPT), "->", repr(by_ids["choices"][0]["text"]))
assert stopped["choices"][0]["text"] == choice["text"][: choice["text"].index(".")]
assert by_ids["choices"][0]["text"] == tok.decode(choice["token_ids"][:2])
assert by_ids["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]

# %% [markdown]
# ## 2. `echo` with `logprobs`: the prompt, scored
#
# `echo: true` puts the prompt in front of the answer, and with `logprobs: N` the prompt's
# tokens come with scores too: `tokens` (each token's text), `token_logprobs` (its
# log-probability given everything before it), `top_logprobs` (the N most likely tokens at that
# position, plus the actual one) and `text_offset` (where each token starts in the text). The
# first token has no score: nothing comes before it to predict it from. With `max_tokens` 0
# nothing is generated, so `completion_tokens` is 0 and the finish reason is `length`.
#
# The check: the score of the token at position p is row p - 1 of log_softmax of the model's
# logits, `completions.logits_of` (one forward of the same model in this process, no cache).

# %%
# NBVAL_IGNORE_OUTPUT
# (third decimals move with the CPU's summation order: a score printed -2.438 on the AVX-512
# EPYC these outputs come from prints -2.439 on an AVX2 machine; the asserts below hold on
# every CPU, so they are the check)
echo = kinds["echo, score only"]["choices"][0]
lp = echo["logprobs"]
ids = tok.encode(completions.PROMPT)
ref = completions.logits_of(model, ids).log_softmax(-1)  # (T, V): row p predicts position p + 1
print(f"{'pos':>3}  {'token':<10} {'offset':>6}  {'logprob':>8}  {'reference':>9}  top 2")
columns = zip(lp["tokens"], lp["text_offset"], lp["token_logprobs"], lp["top_logprobs"])
for p, (t, o, s, top) in enumerate(columns):
    r = "" if p == 0 else f"{ref[p - 1, ids[p]].item():9.3f}"
    shown = "" if top is None else {k: round(v, 3) for k, v in top.items()}
    print(f"{p:>3}  {t!r:<10} {o:>6}  {'None' if s is None else f'{s:8.3f}':>8}  {r:>9}  {shown}")
assert echo["text"] == completions.PROMPT and lp["token_logprobs"][0] is None
assert lp["tokens"] == [tok.token_text(t) for t in ids]
worst = max(abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) for p in range(1, len(ids)))
assert worst < 1e-4, worst
print("every score equals log_softmax of the model's logits (within 1e-4)")

# %% [markdown]
# ## 3. Scoring a continuation, the way a harness does
#
# A multiple-choice question is scored one option at a time: the context ("Question: ...
# Answer:") followed by the option, and the option's log-likelihood is the sum of the scores of
# its own tokens. The harness sends context and option as token ids (tokenized separately, so
# the context's tokens are the same in every option and `ctxlen` says where the option starts),
# all four options as one list of prompts, `echo`, `logprobs: 1`, `max_tokens: 0`. Here it
# goes through the official `openai` client. Our scorer is three lines; the reference is the
# same sum read off log_softmax of the model's logits, one forward per option, and the two must
# agree. The script's `reference_sums` computes the same thing, and its committed rows for this
# question (the first four of `day-36-scores.csv`) must be what this cell gets.

# %%
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
context, options, right = completions.QUESTIONS[0]
ctx = tok.encode(context)
prompts = [ctx + tok.encode(o) for o in options]
resp = client.completions.create(
    model=completions.MODEL_NAME, prompt=prompts, echo=True, logprobs=1, max_tokens=0
)


def score(logprobs, ctxlen):
    """An option's log-likelihood: the sum of the scores from ctxlen on."""
    return sum(logprobs.token_logprobs[ctxlen:])


ours = [score(c.logprobs, len(ctx)) for c in sorted(resp.choices, key=lambda c: c.index)]
lps = [completions.logits_of(model, p).log_softmax(-1) for p in prompts]  # (T, V) each
refs = [sum(lp[q - 1, p[q]].item() for q in range(len(ctx), len(p))) for p, lp in zip(prompts, lps)]
print(repr(context), "ctxlen", len(ctx))
for o, s, r in zip(options, ours, refs):
    print(f"  {o!r:<9} server {s:8.3f}   from the logits {r:8.3f}")
assert all(abs(s - r) < 1e-4 for s, r in zip(ours, refs))
table = committed("scores")
assert [float(r["server_sum"]) for r in table[:4]] == [round(s, 3) for s in ours]
assert [float(r["reference_sum"]) for r in table[:4]] == [round(r, 3) for r in refs]
print("picked:", repr(options[max(range(4), key=lambda i: ours[i])]), "| right:", repr(options[right]))
top = resp.choices[0].logprobs.top_logprobs[len(ctx)]  # the alternatives where the option starts
print("most likely token after the context:", repr(max(top, key=top.get)), f"{max(top.values()):.3f}")

# %% [markdown]
# The script scores six such questions; its table is the journal's. `greedy` says whether every
# option token was also the most likely one at its position (a harness reports it as
# `is_greedy`); `shifted` is section 4's scorer.

# %%
print(f"{'q':>2} {'option':<9} {'right':>5} {'server':>8} {'logits':>8} {'shifted':>8} {'picked':>6}")
for r in table:
    print(f"{r['question']:>2} {r['option']:<9} {r['right']:>5} {float(r['server_sum']):8.3f} "
          f"{float(r['reference_sum']):8.3f} {float(r['shifted_sum']):8.3f} {r['picked']:>6}")  # fmt: skip
n_q = len({r["question"] for r in table})
right_picks = sum(r["right"] == "yes" and r["picked"] == "yes" for r in table)
right_shifted = sum(r["right"] == "yes" and r["picked_shifted"] == "yes" for r in table)
print(f"right answer picked: {right_picks} of {n_q} questions (the shifted scorer: {right_shifted})")
print("greedy options:", sum(r["greedy"] == "yes" for r in table), "of", len(table))

# %% [markdown]
# SmolLM2-135M picks the right option in half of these questions; the point of the table is
# not the model's knowledge but that the server's sums and the logits' sums agree to the third
# decimal in every row. No option is greedy: after "Answer:" the model's most likely next token
# is ' The' (printed in section 3), not any option, so the `is_greedy` flag says nothing useful
# at this size.
#
# ## 4. A scorer one position off
#
# The classic mistake in writing a scorer from logits: forgetting that the row of position p
# predicts the token at p + 1, and reading token p's score from row p. It still returns a
# number for every option, often a plausible one, and in the table above it even picks the
# same option as the right scorer in some questions. Only a comparison with a known-good score
# catches it. `check_scores` is that comparison, and the server's echo is the known-good score.


# %%
def check_scores(server_sums, candidate_sums, tol=1e-4):
    for i, (s, c) in enumerate(zip(server_sums, candidate_sums)):
        if abs(s - c) > tol:
            raise AssertionError(f"option {i}: the server scores {s:.3f}, the candidate {c:.3f}")


check_scores(ours, refs)  # the right scorer passes
shifted = [sum(lp[q, p[q]].item() for q in range(len(ctx), len(p))) for p, lp in zip(prompts, lps)]
assert [float(r["shifted_sum"]) for r in table[:4]] == [round(x, 3) for x in shifted]  # the script's too
try:
    check_scores(ours, shifted)
except AssertionError as e:
    print("shifted scorer -> AssertionError:", e)
else:
    raise AssertionError("the off-by-one scorer passed")

# %% [markdown]
# ## 5. `n` and `best_of`
#
# `n` asks for several answers to one prompt. Each is a sample of its own, and the server
# seeds sample j with seed + j, so a seeded request can be sent again for the same answers.
# Inside the engine the extra samples wait until the first has its prompt in the cache and then
# share its blocks (Day 19's prefix cache).
#
# `best_of` draws that many samples and returns the `n` with the highest mean log-probability
# per token. The usage counts every sample drawn, returned or not: in the table, `best_of 5, n
# 2` returned 2 answers and charged 20 completion tokens, 5 x 4. The table's `n 5` request has
# the same prompt, seed and length, so it drew the very samples best_of chose from, and it
# asked for their scores (`logprobs: 0`, the chosen token's score and no alternatives). So
# which two best_of kept can be worked out from it:

# %%
five = kinds["n 5, seeded, scored"]
means = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in five["choices"]]
kept = [c["text"] for c in kinds["best_of 5, n 2"]["choices"]]
for j, (c, m) in enumerate(zip(five["choices"], means)):
    mark = "   kept by best_of" if c["text"] in kept else ""
    print(f"  sample {j}: {c['text']!r:<36} mean logprob {m:7.3f}{mark}")
best_two = [five["choices"][j]["text"] for j in sorted(range(5), key=lambda j: -means[j])[:2]]
assert kept == best_two and len({c["text"] for c in five["choices"]}) == 5
assert kinds["best_of 5, n 2"]["usage"]["completion_tokens"] == five["usage"]["completion_tokens"] == 20

# %% [markdown]
# ## 6. A list of prompts, and what it saves
#
# A list of prompts gets one choice per prompt and sample, in order: choice `index` is
# prompt i x n + sample j, so the two greedy answers to "Red" are 0 and 1, "Green"'s 2 and 3.
# `prompt_tokens` is the sum over the prompts.

# %%
listed = kinds["3 prompts, n 2"]
for c in listed["choices"]:
    print(f"  index {c['index']}: {c['text']!r}")
texts = [c["text"] for c in listed["choices"]]
assert [c["index"] for c in listed["choices"]] == list(range(6))
assert texts[0::2] == texts[1::2]  # greedy: both samples of a prompt agree
assert listed["usage"]["prompt_tokens"] == sum(len(tok.encode(p)) for p in ["Red", "Green", "Blue"])

# %% [markdown]
# For scoring, the list is also the faster way. Four options sent as four requests, one after
# another, are four prefill steps of the engine; sent as one list, the scheduler finds all four
# prompts waiting at once and computes them in one step (their tokens together, printed below,
# are far under the step's budget of 512). One question here, all six in the script's run:

# %%
budget = engine.config.max_num_batched_tokens
print("tokens of the four prompts:", sum(map(len, prompts)), "| step budget:", budget)
way = completions.batching_table(url, engine, tok, completions.QUESTIONS[:1])
for w in way:
    print(f"  {w['way']:<31} requests {w['requests']}, engine steps {w['engine_steps']}")
assert [w["engine_steps"] for w in way] == [1, 4]
full = committed("batching")
for w in full:
    print(f"  all six: {w['way']:<31} requests {w['requests']:>2}, engine steps {w['engine_steps']:>2}")

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
print(f"this run, one question: a list {way[0]['ms']:.0f} ms, one request per option {way[1]['ms']:.0f} ms")
a, b = (float(w["ms"]) for w in full)
print(f"the script's run, six questions: {a:.0f} ms against {b:.0f} ms ({b / a:.1f}x)")

# %% [markdown]
# ## 7. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9))
fig.suptitle("Day 36 — OpenAI-compatible completions (SmolLM2-135M, CPU)", fontsize=14)

ax = axes[0, 0]
blue, lp_all = prompts[right], lps[right]
echoed = sorted(resp.choices, key=lambda c: c.index)[right].logprobs.token_logprobs
xs = list(range(1, len(blue)))
ax.plot(xs, [echoed[p] for p in xs], "o-", label="server (echo)", color="tab:blue")
ax.plot(xs, [lp_all[p - 1, blue[p]].item() for p in xs], "x", ms=10, color="k", label="log_softmax row p - 1")
ax.plot(xs, [lp_all[p, blue[p]].item() for p in xs], "s--", color="tab:red", alpha=0.7,
        label="row p (the off-by-one)")  # fmt: skip
ax.axvspan(len(ctx) - 0.5, len(blue) - 0.5, color="gold", alpha=0.3, label="the option's tokens")
ax.set_xticks(xs, [tok.token_text(t) for t in blue[1:]], rotation=70, fontsize=8)
ax.set_ylabel("log-probability")
ax.set_title(f"each prompt position's score ({options[right].strip()!r} option of question 0)")
ax.legend(fontsize=8, loc="lower left")

ax = axes[0, 1]
for q in range(n_q):
    rows_q = [r for r in table if int(r["question"]) == q]
    for i, r in enumerate(rows_q):
        x = q * 5 + i
        color = "tab:green" if r["right"] == "yes" else "tab:gray"
        ax.bar(x, float(r["server_sum"]), color=color, edgecolor="k" if r["picked"] == "yes" else None, lw=2)
        ax.text(x, 0.3, r["option"], rotation=90, ha="center", va="bottom", fontsize=7)
ax.set_xticks([q * 5 + 1.5 for q in range(n_q)], [f"q{q}" for q in range(n_q)])
ax.set_ylim(top=7)
ax.set_ylabel("sum of the option's token logprobs")
ax.set_title("six questions: right option green, the pick outlined")

ax = axes[1, 0]
ax.bar(range(5), means, color=["tab:orange" if c["text"] in kept else "tab:gray" for c in five["choices"]])
ax.set_xticks(range(5), [f"sample {j}" for j in range(5)])
ax.set_ylabel("mean logprob per token")
ax.set_title("best_of 5, n 2 keeps the two best per token (orange)")

ax = axes[1, 1]
x = range(len(full))
ax.bar([i - 0.2 for i in x], [int(w["engine_steps"]) for w in full], 0.4, label="engine steps")
ax.bar([i + 0.2 for i in x], [int(w["requests"]) for w in full], 0.4, label="requests")
ax2 = ax.twinx()
ax2.plot(list(x), [float(w["ms"]) / 1000 for w in full], "ko--", label="wall time (s, script's run)")
ax2.set_ylim(bottom=0)
ax.set_xticks(list(x), [w["way"] for w in full], fontsize=9)
ax.set_ylabel("count")
ax2.set_ylabel("seconds")
ax.set_title("scoring 24 options: one list a question against one request each")
h = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
ax.legend(h, [x.get_label() for x in h], fontsize=9, loc="upper left")
fig.tight_layout()
path = diagram_path("day36-completions.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %%
server.__exit__(None, None, None)  # the server and its engine loop stop here
print("server stopped; blocks still held:", engine.allocator.num_used)

# %% [markdown]
# ## In the real systems
#
# * **vLLM** serves this route from `vllm/entrypoints/openai/serving_completion.py`
#   (`OpenAIServingCompletion.create_completion`), on the schema of `protocol.py`
#   (`CompletionRequest`). Like ours, it treats `echo` with `max_tokens` 0 as "return the prompt
#   and its scores", asks the engine for `prompt_logprobs` when echo and logprobs are both set,
#   and numbers a list's choices as the prompt's index times the choices per prompt plus the
#   sample's own index.
# * **Evaluation harnesses** are the heaviest users of echo. lm-evaluation-harness's first
#   OpenAI backend sent the context and continuation with echo and `max_tokens` 0 and summed
#   `token_logprobs[ctxlen:]`, exactly the scorer of section 3; its later `local-completions`
#   backend asks for `max_tokens` 1 and drops the last entry instead (`[ctxlen:-1]`), since
#   some servers refuse 0. tests/test_scores.py runs that second recipe against this server.
# * **llama.cpp**'s `llama-server` answers `/v1/completions` beside its own `/completion` (which
#   takes `n_probs` for the alternatives), but an open issue on its tracker (#27174) reports
#   that its `logprobs` cover the generated tokens only, with no scores for an echoed prompt, so
#   a harness scoring through it gets no continuation scores at all. **OpenAI** itself keeps the
#   completions route as legacy, and its `gpt-3.5-turbo-instruct` answers `echo` together with
#   `logprobs` with a 400 (`invalid_parameter_combination`): prompt scores are what open servers
#   offer and the hosted API no longer does.
#
# ## Try it
#
# 1. **Move the slice by one on the client side.** In section 3, score with
#    `sum(logprobs.token_logprobs[ctxlen - 1:])`. The check: every option's sum changes by the
#    same amount (the score of the context's last token, the same for all four), so the pick
#    does not move, yet `check_scores(ours, wrong)` raises for every option. An accuracy number
#    would not have caught this one.
# 2. **Ask a harness-style request with `max_tokens: 1`.** Send section 3's prompts with
#    `max_tokens=1`. The check: each choice's `token_logprobs` is one longer, and
#    `sum(token_logprobs[ctxlen:-1])` equals `ours` to within 1e-4.
# 3. **Rank best_of's samples by the sum.** Rank section 5's samples by the sum of their
#    logprobs instead of the mean and take the top two texts (`sum_two`). The check: with all
#    five samples 4 tokens long the two rules are one rule, so `assert sum_two == best_two ==
#    kept` holds; only samples of different lengths (a `"stop": ["."]` in the request) can tell
#    them apart.
