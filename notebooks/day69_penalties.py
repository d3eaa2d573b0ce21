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
# # Day 69 — Sampling penalties
#
# Ask a 135M model for a story and, greedy, it soon writes the same clause again and again: each
# time a phrase comes back, the phrase is more likely to come back once more, and the argmax
# follows it around the loop. Sampling with a temperature breaks some loops by chance. The
# penalties break them on purpose, by lowering the logit of every token the sequence already
# holds before the token is picked, greedy or not. Three of them, each a few tensor ops on a
# row of logits:
#
# * **repetition** r (vLLM's `repetition_penalty`): every token id that occurs in the prompt or
#   the answer so far has its logit divided by r when it is positive and multiplied by r when it
#   is not. Both move the logit down for r > 1, and a token seen ten times is treated as one seen
#   once.
# * **frequency** f (OpenAI's `frequency_penalty`): f times the token's count in the answer so far
#   is taken off its logit. The prompt does not count.
# * **presence** p (OpenAI's `presence_penalty`): p is taken off the logit of every token the
#   answer so far holds at least once. The prompt does not count either.
#
# The engine has had them since its server began to accept vLLM's sampling fields
# (`nanoserve/sampling.py`: `SamplingParams`, `adjust_logits`); no day has taught them yet. This
# notebook:
#
# 1. writes the three penalties by hand on a logits vector and the tokens seen, and holds
#    `adjust_logits` to them exactly,
# 2. plants two classic mistakes and watches the equality check fail on each,
# 3. runs the real model on a story prompt whose greedy answer loops, under each penalty at two
#    strengths, and counts what repeats (the day's table, `days/day69/penaltybench.py`),
# 4. shows that the log-probabilities the engine reports are those of the raw logits: a penalty
#    changes the token picked, never the score printed for it,
# 5. reads what a penalized step costs from the script's table,
# 6. draws the diagram.
#
# The engine is day 69's (`engine_config(69, ...)`) over the default model, SmolLM2-135M-Instruct,
# from its GGUF's own Q4_1 blocks (day 60) with the fused decode step (day 61), decode attention
# in place (day 58) and the budget schedule (day 57). Activations are fp32 rather than the
# int8 the server uses: the comparisons below are token for token, and int8 rounding turns a
# near-tie between two tokens into a coin the CPU flips.

# %%
import re
import sys
import time
from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve.bench import cpu_line
from nanoserve.sampling import SamplingParams, adjust_logits

sys.path.insert(0, str(REPO / "days" / "day69"))
import penaltybench  # the day's script: the notebook calls its functions and reads its tables

print(cpu_line())
T0 = time.perf_counter()

# %% [markdown]
# ## 1. The three penalties by hand
#
# What a penalty needs is which tokens the row has seen and how often. Counting is one
# `torch.bincount` over the token ids with `minlength` the vocabulary: a (V,) vector of counts,
# zero for every token the row never held. Repetition looks at prompt and answer together and
# only asks "seen or not"; frequency and presence look at the answer alone, frequency at the
# count and presence at "seen or not".


# %%
def penalize_by_hand(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0):
    """One row's logits (V,) after the repetition, frequency and presence penalties, in that
    order (vLLM's): repetition over prompt and output, the other two over the output only."""
    vocab = logits.shape[-1]
    seen = torch.bincount(torch.tensor(prompt + output, dtype=torch.long), minlength=vocab) > 0
    count = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    x = torch.where(seen, penalized, logits)
    return x - frequency * count - presence * (count > 0).float()


def package(logits, prompt, output, **kw):
    """The package's `adjust_logits` on the same row: history is the row's ids, prompt first,
    and how many of them are the prompt."""
    p = SamplingParams(**kw).validate()
    return adjust_logits(logits[None], [p], [0], [(prompt + output, len(prompt))])[0]


LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
PROMPT, OUTPUT = [0, 3], [3, 1, 3, 5]
ONE_EACH = {"repetition 2": dict(repetition=2.0), "frequency 0.6": dict(frequency=0.6),
            "presence 0.25": dict(presence=0.25)}  # fmt: skip
columns = {name: penalize_by_hand(LOGITS, PROMPT, OUTPUT, **kw) for name, kw in ONE_EACH.items()}
in_prompt = Counter(PROMPT)
in_output = Counter(OUTPUT)
print(f"prompt {PROMPT}, output so far {OUTPUT}")
print(f"{'token':>5} {'prompt':>6} {'output':>6} {'raw':>6} " + " ".join(f"{n:>14}" for n in columns))
for t in range(len(LOGITS)):
    print(f"{t:>5} {in_prompt[t]:>6} {in_output[t]:>6} {LOGITS[t].item():>6.2f} "
          + " ".join(f"{col[t].item():>14.2f}" for col in columns.values()))  # fmt: skip
print(f"{'greedy token':>26} {LOGITS.argmax().item():>3} "
      + " ".join(f"{col.argmax().item():>14}" for col in columns.values()))  # fmt: skip
to_package = dict(repetition="repetition_penalty", frequency="frequency_penalty", presence="presence_penalty")
for name, kw in ONE_EACH.items():
    theirs = package(LOGITS, PROMPT, OUTPUT, **{to_package[k]: v for k, v in kw.items()})
    assert torch.equal(columns[name], theirs), name
print("each column equals adjust_logits exactly")

# %% [markdown]
# Token 0 is only in the prompt: repetition halves its 2.00 to 1.00, frequency and presence leave
# it alone. Token 1 was generated once with a negative logit, so repetition multiplies: -1.00
# becomes -2.00, further from the top, as a penalty should. Token 3 is in the prompt and twice in
# the answer: repetition treats it as seen (3.00 to 1.50, the same as once), frequency takes 0.6
# twice (1.80), presence once (2.75). Tokens 2 and 4 were never seen and keep their logits under
# every penalty. The greedy pick moves off token 3 under frequency (to token 0, which the answer
# never wrote), and stays under the other two at these strengths.
#
# A six-token row is easy to get right by accident. The same check over the real vocabulary,
# 49,152 logits drawn at random, a prompt and an answer drawn from a few hundred ids so that
# most of them repeat, and the three penalties together at strengths drawn from their ranges:

# %%
VOCAB = 49152
rng = torch.Generator().manual_seed(69)


def random_case(g):
    """(logits, prompt, output, SamplingParams fields) for one random row."""
    logits = torch.randn(VOCAB, generator=g) * 4
    prompt = torch.randint(300, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
    output = torch.randint(300, (int(torch.randint(0, 120, (1,), generator=g)),), generator=g).tolist()
    u = torch.rand(3, generator=g).tolist()
    kw = dict(
        repetition_penalty=0.5 + 1.5 * u[0], frequency_penalty=4 * u[1] - 2, presence_penalty=4 * u[2] - 2
    )
    return logits, prompt, output, kw


CASES = [random_case(rng) for _ in range(40)]
print(f"{len(CASES)} rows of {VOCAB:,} logits")
short_name = {
    "repetition_penalty": "repetition",
    "frequency_penalty": "frequency",
    "presence_penalty": "presence",
}
equal = sum(
    torch.equal(
        penalize_by_hand(lg, pr, out, **{short_name[k]: v for k, v in kw.items()}), package(lg, pr, out, **kw)
    )
    for lg, pr, out, kw in CASES
)
moved = sum(int((penalize_by_hand(lg, pr, out, 1.3, 0.5, 0.5) != lg).sum()) for lg, pr, out, _ in CASES)
print(f"{equal} of {len(CASES)} random rows equal adjust_logits bit for bit ({moved} logits moved in all)")
assert equal == len(CASES)

# %% [markdown]
# Bit for bit, not within a tolerance: the hand version and the package do the same float
# operations in the same order (a division by 1.0 and a subtraction of 0.0 leave an unseen
# token's logit exactly as it was). The package counts with one `scatter_add_` over the rows'
# id lists padded with the id V to one width, into V + 1 columns whose last is dropped
# (`token_counts`): a bincount for a whole batch of rows at once. vLLM pads the same way.
#
# ## 2. Two planted mistakes
#
# Both are easy to make and look plausible in review. The first applies the repetition penalty
# as one multiplication, `logit * r` for every seen token, the sign forgotten: a positive logit
# then goes *up*, and the penalty rewards what it was meant to punish. The second counts the
# prompt for the frequency penalty, so a word the user wrote is held against the answer.


# %%
def sign_forgotten(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0):
    """Planted: a seen token's logit times r whatever its sign."""
    seen = torch.bincount(torch.tensor(prompt + output, dtype=torch.long), minlength=logits.shape[-1]) > 0
    count = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[-1]).float()
    x = torch.where(seen, logits * repetition, logits)
    return x - frequency * count - presence * (count > 0).float()


def prompt_counted(logits, prompt, output, repetition=1.0, frequency=0.0, presence=0.0):
    """Planted: frequency and presence over prompt and output."""
    return penalize_by_hand(logits, [], prompt + output, repetition, frequency, presence)


for name, wrong in (
    ("repetition as one multiplication", sign_forgotten),
    ("the prompt counted", prompt_counted),
):
    agree = sum(
        torch.equal(
            wrong(lg, pr, out, **{short_name[k]: v for k, v in kw.items()}), package(lg, pr, out, **kw)
        )
        for lg, pr, out, kw in CASES
    )
    print(f"{name}: {agree} of {len(CASES)} random rows equal adjust_logits")
    assert agree < len(CASES)
toy_wrong = sign_forgotten(LOGITS, PROMPT, OUTPUT, repetition=2.0)
print(f"the six-token row, repetition 2 as one multiplication: token 3 goes from {LOGITS[3].item():.2f} "
      f"to {toy_wrong[3].item():.2f}, greedy token {toy_wrong.argmax().item()}")  # fmt: skip

# %% [markdown]
# Neither planted version agrees on a single random row, and on the six-token row the first
# doubles token 3's logit to 6.00, so the token it meant to discourage wins by more than before.
# The prompt-counting one keeps repetition right (the set of seen tokens is the same) and
# fails through frequency and presence alone. `tests/test_penalties.py` holds the package to
# hand-computed rows that either mistake fails: a positive and a negative logit under
# repetition, a token only in the prompt under frequency.
#
# ## 3. The real model: a story that loops
#
# The prompt is "Write a story about a cat.", greedy, at most 96 tokens, under no penalty and
# under each penalty at two strengths: seven requests, one batch. For each answer the script
# counts its distinct tokens, its repeated 3-grams (3-grams that occurred earlier in the same
# answer), the longest stretch it copies from earlier in itself, and the token at which it
# departs from the plain answer. The notebook steps the engine itself, because it also wants
# each token's reported log-probability and five alternatives (`logprobs=5`) for section 4:

# %%
engine = penaltybench.make_engine()
print(re.sub(r"(, tiles)?\), [\d.]+ MB,", "),", engine.paths_line()))
SETTINGS = penaltybench.SETTINGS
MESSAGES = [{"role": "user", "content": penaltybench.PROMPT}]


def answers_with_scores(settings):
    """Each setting's greedy answer with logprobs=5, one batch: [(token ids, [TokenLogprobs])]."""
    ids = [engine.add_request(MESSAGES, penaltybench.params_of(p, s, logprobs=5)) for p, s in settings]
    got = {r: ([], []) for r in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    return [got[r] for r in ids]


RUNS = answers_with_scores(SETTINGS)
TABLE = read_csv(penaltybench.HERE / "day-69-repetition.csv")
plain = RUNS[0][0]
print(f"{'penalty':<19} {'strength':>8} {'tokens':>6} {'distinct':>8} {'repeated 3-grams':>16} "
      f"{'longest copy':>12} {'departs at':>10}")  # fmt: skip
for (penalty, strength), (ids, _), row in zip(SETTINGS, RUNS, TABLE):
    first = next((i for i, (a, b) in enumerate(zip(ids, plain)) if a != b), -1)
    mine = dict(tokens=len(ids), distinct_tokens=len(set(ids)), departs_at=first)
    mine["repeated_3grams"] = penaltybench.repeated_ngrams(ids)
    mine["longest_repeat"] = penaltybench.longest_run(ids)
    print(f"{penalty:<19} {strength:>8} {mine['tokens']:>6} {mine['distinct_tokens']:>8} "
          f"{mine['repeated_3grams']:>16} {mine['longest_repeat']:>12} {first:>10}")  # fmt: skip
    assert {k: str(v) for k, v in mine.items()} == {k: row[k] for k in mine}, (penalty, strength)
print("equal to the script's table (day-69-repetition.csv)")
tok = engine.tokenizer
for i in (0, 2, 4, 6):
    (penalty, strength), (ids, _) = SETTINGS[i], RUNS[i]
    print(f"\n{penalty} {strength}: {tok.decode(ids[:60])!r}")

# %% [markdown]
# The plain answer names its cat Luna and then loops: "a cat with a tail, a cat with a heart, and
# a cat with a heart", again and again. Of its 96 tokens only 28 are distinct, 38 of its 3-grams
# occurred earlier in it, and its longest copy of itself is 20 tokens. Every penalty breaks the
# loop, each in its own way:
#
# * **Repetition** departs first: at token 1 with r 1.3, because "cat" is in the *prompt* and the
#   penalty counts the prompt. The model writes about a night in a city, with cats only in
#   passing: 88 distinct tokens and no repeated 3-gram at all. At 1.1 it keeps "cat" longer (it departs at
#   token 9) and still ends with 76 distinct tokens. Counting the prompt is the choice that
#   makes a repetition penalty steer the topic, whether one wants it or not.
# * **Frequency and presence** see only the answer, so all four answers begin as the plain one
#   does and depart only once the answer starts to repeat itself (tokens 15 to 17). Frequency at
#   0.2 and 0.5 give nearly the same counts here (62 and 64 distinct, 2 repeated 3-grams each); presence
#   at 1.0 reaches no repeated 3-gram with 65 distinct tokens.
#
# These are counts of one greedy answer from a 135M model, not a verdict on the penalties: a
# penalty strong enough to break a loop also pushes a model off the words a topic needs (a story
# about a cat has to say "cat"), which is why they are off by default and asked for per request.
#
# ## 4. The scores stay the model's
#
# The engine reports `log_softmax` of the raw logits, before any penalty (the sampler's module
# doc; vLLM's default, `raw_logprobs`). A penalty changes which token is picked, so a penalized
# greedy answer can pick a token that is not the raw argmax, and its reported log-probability
# is then below the best alternative's. A plain greedy answer never does:

# %%
for (penalty, strength), (ids, scores) in zip(SETTINGS, RUNS):
    assert [s.token_id for s in scores] == ids
    below = sum(s.top[0][0] != s.token_id and s.logprob < s.top[0][1] for s in scores)
    print(f"{penalty:<19} {strength:>4}: {below:>2} of {len(ids)} tokens are not the raw argmax")
    if penalty == "none":
        assert below == 0

# %% [markdown]
# Up to the token where an answer departs, the penalized row and the plain row have the same
# context, so the model's raw distribution there is the same and the engine must report the same
# scores. At token 1, where repetition 1.3 turns away from "cat":

# %%
at = int(TABLE[2]["departs_at"])
plain_score, penalized_score = RUNS[0][1][at], RUNS[2][1][at]
print(f"token {at}, after {tok.decode(plain[:at])!r}: the five likeliest, as each run reports them")
for (t, lp), (t2, lp2) in zip(plain_score.top, penalized_score.top):
    assert t == t2 and abs(lp - lp2) < 1e-3
    print(f"  {tok.decode([t])!r:>12} {lp:8.3f}   {lp2:8.3f}")
print(f"plain picks {tok.decode([plain_score.token_id])!r} ({plain_score.logprob:.3f}); "
      f"repetition 1.3 picks {tok.decode([penalized_score.token_id])!r} "
      f"and reports {penalized_score.logprob:.3f}")  # fmt: skip
assert plain_score.token_id != penalized_score.token_id and penalized_score.logprob < plain_score.logprob

# %% [markdown]
# The same five tokens with the same scores in both runs: the penalty is invisible in what is
# reported and visible only in the pick. That is the contract a client needs. A score of a text
# means the same whatever sampling settings came with the request, and an evaluation harness
# that asks for `logprobs` alongside a penalty gets the model's numbers, not the sampler's.
#
# ## 5. What a penalized step costs
#
# A step where no row asks for an adjustment runs exactly the sampler it ran before the
# penalties existed: the engine does not even gather the rows' token ids. A step with one
# builds each penalized row's id list (prompt and answer so far), counts it into a (rows, V)
# table with one scatter, and runs a few elementwise ops over (rows, V) logits; the model's
# work is the same. The script times a decode step of the engine with every row penalized
# (repetition 1.3, frequency 0.5, presence 0.5) against the same step with none, at 1 and 8
# rows, alternating the two; `sampler_ms` times `sample_rows` alone on the same shapes. These
# are measurements of the machine that ran the script (its `cpu` column names it):

# %%
COST = read_csv(penaltybench.HERE / "day-69-cost.csv")
print(f"{'rows':>4} {'penalties':>9} {'step ms':>8} {'sampler ms':>10} {'ratio to off':>12}")
for c in COST:
    print(
        f"{c['rows']:>4} {c['penalties']:>9} {c['step_ms']:>8} {c['sampler_ms']:>10} {c['ratio_to_off']:>12}"
    )

# %% [markdown]
# What to read in it: the model's step is the same with or without penalties, so any difference
# is the counting and the elementwise pass, and the sampler column shows it in isolation. Both
# grow with the rows and with the length of the id lists, not with the model, so on a bigger
# model the share of a step they take only shrinks. The step's difference between off and on is
# about what the sampler column adds, at both sizes; a difference that small moves from run to
# run on a shared machine, so read the table for where the cost lies rather than for a ratio.
#
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(15, 10))
fig.subplots_adjust(hspace=0.45, wspace=0.25)
COLORS = {"none": "#999999", "repetition_penalty": "#3d85c6", "frequency_penalty": "#e69138",
          "presence_penalty": "#6aa84f"}  # fmt: skip

ax = axes[0, 0]
width = 0.2
names = ["raw"] + list(columns)
values = [LOGITS] + list(columns.values())
for j, (name, vals) in enumerate(zip(names, values)):
    color = [
        "#999999",
        COLORS["repetition_penalty"],
        COLORS["frequency_penalty"],
        COLORS["presence_penalty"],
    ][j]
    ax.bar([t + (j - 1.5) * width for t in range(len(LOGITS))], vals.tolist(), width, color=color, label=name)
ax.axhline(0, color="black", linewidth=0.8)
ticks = [f"{t}\n{in_prompt[t]} / {in_output[t]}" for t in range(len(LOGITS))]
ax.set_xticks(range(len(LOGITS)), ticks, fontsize=9)
ax.set_xlabel("token id, and how often it is in the prompt / the output")
ax.set_ylabel("logit")
ax.set_title("section 1: six logits, prompt [0, 3], output [3, 1, 3, 5]", fontsize=11)
ax.set_ylim(-2.5, 4.5)
ax.legend(fontsize=8, loc="upper right", ncol=2)

ax = axes[0, 1]
labels = [f"{p.replace('_penalty', '')} {s:g}" if p != "none" else "none" for p, s in SETTINGS]
distinct = [int(r["distinct_tokens"]) for r in TABLE]
repeated = [int(r["repeated_3grams"]) for r in TABLE]
xs = range(len(TABLE))
ax.bar([x - 0.2 for x in xs], distinct, 0.4, color="#3d85c6", label="distinct tokens")
ax.bar([x + 0.2 for x in xs], repeated, 0.4, color="#e06666", label="repeated 3-grams")
for x, d, r in zip(xs, distinct, repeated):
    ax.text(x - 0.2, d + 1, str(d), ha="center", fontsize=8)
    ax.text(x + 0.2, r + 1, str(r), ha="center", fontsize=8)
ax.set_xticks(list(xs), labels, rotation=25, ha="right", fontsize=9)
ax.set_ylim(0, 112)
ax.set_ylabel("count in a 96-token answer")
ax.set_title("section 3: the story's greedy answer under each penalty", fontsize=11)
ax.legend(fontsize=9, loc="upper right")

ax = axes[1, 0]
for i in (0, 2, 4, 6):
    (penalty, strength), (ids, _) = SETTINGS[i], RUNS[i]
    seen, curve = set(), []
    for k in range(len(ids) - 2):
        gram = tuple(ids[k : k + 3])
        curve.append((curve[-1] if curve else 0) + (gram in seen))
        seen.add(gram)
    ax.plot(range(3, len(ids) + 1), curve, color=COLORS[penalty], label=labels[i])
ax.set_xlabel("tokens of the answer")
ax.set_ylabel("repeated 3-grams so far")
ax.set_title("where the loop starts, and which penalty stops it", fontsize=11)
ax.legend(fontsize=9, loc="upper left")

ax = axes[1, 1]
for j, rows in enumerate(("1", "8")):
    for k, state in enumerate(("off", "on")):
        c = next(c for c in COST if c["rows"] == rows and c["penalties"] == state)
        x = j * 3 + k
        ax.bar(x, float(c["step_ms"]), color="#999999" if state == "off" else "#3d85c6")
        ax.text(x, float(c["step_ms"]), f"{float(c['step_ms']):.1f}", ha="center", va="bottom", fontsize=8)
ax.set_xticks([0, 1, 3, 4], ["1 row\noff", "1 row\non", "8 rows\noff", "8 rows\non"])
ax.set_ylabel("ms a decode step (best of the script's runs)")
ax.set_title("section 5: a step with penalties off and on (day-69-cost.csv)", fontsize=11)
fig.suptitle("Day 69: sampling penalties (SmolLM2-135M-Instruct, greedy, 'Write a story about a cat.')",
             fontsize=14)  # fmt: skip
png = diagram_path("day69-penalties.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")

# %% [markdown]
# Top left, section 1's six logits raw and under each penalty alone: token 0 (prompt only) moves
# under repetition alone, token 1's negative logit goes further down, token 3 (prompt and twice in
# the answer) loses most under frequency, tokens 2 and 4 (never seen) stay put. Top right, the
# day's table: distinct tokens and repeated 3-grams of the story's answer under each setting.
# Bottom left, repeated 3-grams accumulated along the answer: the plain answer's count climbs
# steadily once its loop sets in, while the three penalties at their stronger setting stay near
# zero. Bottom right, the script's decode step with penalties off and on.
#
# ## In the real systems
#
# * **vLLM** takes `repetition_penalty`, `frequency_penalty` and `presence_penalty` in
#   `SamplingParams` (the OpenAI server passes the last two from the request and the first as a
#   vLLM extra). Its `apply_penalties` (`vllm/model_executor/layers/utils.py`; the v1 sampler
#   keeps its penalty code in `vllm/v1/sample/ops/penalties.py`) pads the prompt and the output
#   ids with the vocabulary size, takes bin counts and masks of each, sets the repetition factor
#   to 1 for tokens in neither, divides positive logits and multiplies the rest, then subtracts
#   frequency times the output counts and presence times the output mask. That is what
#   `adjust_logits` does, in the same order, with the same padding trick in `token_counts`. Its
#   logprobs are raw by default (`logprobs_mode="raw_logprobs"`), as here.
# * **llama.cpp** has one sampler for all three, `llama_sampler_init_penalties(penalty_last_n,
#   penalty_repeat, penalty_freq, penalty_present)`, set from `--repeat-last-n`,
#   `--repeat-penalty`, `--frequency-penalty` and `--presence-penalty`. The difference is the
#   window: it counts only the last `penalty_last_n` tokens it was given (0 turns the sampler
#   off, -1 means the whole context), where nanoserve and vLLM count everything. Its header notes
#   that the search over repeated tokens is slow on the full vocabulary and suggests putting top-k
#   or top-p first. Its repetition penalty has the same sign rule (the CTRL penalty "with negative
#   logit fix"); frequency and presence follow OpenAI's description.
# * **transformers** has `RepetitionPenaltyLogitsProcessor` (`generate(repetition_penalty=...)`):
#   it gathers the scores at the ids in `input_ids`, multiplies the negative ones by the penalty
#   and divides the rest, and scatters them back, so a token is penalized once however often it
#   occurs. For a decoder-only model `input_ids` holds the prompt too, as vLLM's repetition
#   penalty does. Try it 3 holds it to `adjust_logits`.
# * **OpenAI's API** defines frequency and presence as this notebook does (an additive
#   `count * f + (count > 0) * p`, each in [-2, 2]); a negative value rewards repeats instead.
#
# ## Try it
#
# 1. **A window, as llama.cpp counts.** Write `penalize_last_n(logits, prompt, output, n, ...)`
#    that penalizes as `penalize_by_hand` does but counts only the last `n` tokens of prompt and
#    answer together for repetition (and the answer's part of them for frequency and presence).
#    The check: with `n` at least the whole sequence it equals `package` on every case of section
#    1's `CASES`, and with `n = 8` it differs from it on at least one.


# %%
def penalize_last_n(logits, prompt, output, n, repetition=1.0, frequency=0.0, presence=0.0):  # a solution
    window = (prompt + output)[-n:] if n > 0 else []
    kept_output = output[max(0, len(output) - n) :] if n > 0 else []
    return penalize_by_hand(logits, window[: len(window) - len(kept_output)], kept_output,
                            repetition, frequency, presence)  # fmt: skip


full = sum(
    torch.equal(
        penalize_last_n(lg, pr, out, 10**6, **{short_name[k]: v for k, v in kw.items()}),
        package(lg, pr, out, **kw),
    )  # fmt: skip
    for lg, pr, out, kw in CASES
)
windowed = sum(
    torch.equal(
        penalize_last_n(lg, pr, out, 8, **{short_name[k]: v for k, v in kw.items()}),
        package(lg, pr, out, **kw),
    )  # fmt: skip
    for lg, pr, out, kw in CASES
)
print(f"whole window: {full} of {len(CASES)} equal; last 8 tokens: {windowed} of {len(CASES)} equal")
assert full == len(CASES) and windowed < len(CASES)

# %% [markdown]
# 2. **Count the prompt on purpose.** In `nanoserve/sampling.py`'s `adjust_logits`, make the
#    frequency and presence counts cover the prompt too: in the line that builds `generated`,
#    replace `history[i][0][history[i][1] :]` with `history[i][0]`. Predict what section 1 and
#    section 3 print, restart the kernel and rerun. The check: section 1's six-token assert fails
#    on the frequency column (token 0, in the prompt only, loses 0.6), and so does
#    `python -m pytest tests/test_penalties.py -q -k count_the_output_only`. Section 3's frequency
#    and presence answers then depart from the plain one at token 1, as repetition's does, since
#    "cat" now counts against them. Put the line back.
# 3. **transformers' repetition penalty.** Build transformers' `RepetitionPenaltyLogitsProcessor`
#    with r 1.3 and call it with `input_ids` the prompt and answer of each section 1 case, as a
#    (1, L) tensor, on a copy of that case's logits as (1, V). The check: on every case it equals
#    `package(..., repetition_penalty=1.3)` bit for bit, repeated ids and all. (The cell below is a
#    solution; replace it with yours.)

# %%
import warnings  # noqa: E402

with warnings.catch_warnings():  # transformers' import warns that the notebook has no widgets
    warnings.simplefilter("ignore")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

hf = RepetitionPenaltyLogitsProcessor(1.3)
same = sum(
    torch.equal(
        hf(torch.tensor([pr + out]), lg[None].clone())[0], package(lg, pr, out, repetition_penalty=1.3)
    )
    for lg, pr, out, _ in CASES
)
print(f"transformers' RepetitionPenaltyLogitsProcessor: {same} of {len(CASES)} equal adjust_logits")
assert same == len(CASES)
