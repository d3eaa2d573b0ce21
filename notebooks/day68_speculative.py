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
# # Day 68 — Speculative decoding by n-gram lookup
#
# At one row, a decode step is a pass over every weight of the model for one token. Each linear
# is a matrix times a single vector, so the step's time goes into reading the weights from
# memory, and the arithmetic waits on it. Give the same pass a few more tokens of the same row
# and it reads the weights once for all of them: the arithmetic grows with the tokens, the
# reading does not. Speculative decoding spends that spare arithmetic. It guesses the row's next
# few tokens (a *draft*), runs the row's newest token and the draft as one chunk, and keeps the
# guesses the model agrees with. A step then yields anything from one token (the first guess
# refused: the model's own token in its place) to K + 1 (all K guesses kept, and the model's
# token after them).
#
# Here the guesses cost no model at all. If the last few tokens of a row appeared earlier in its
# prompt or its answer, what followed them then is a good guess for what follows now: prompt
# lookup. It is right when the answer copies its context, as code written out again with one
# change, a quoted passage, a repeated list, and, with a small model, an answer that loops. The
# rule for keeping guesses leaves the output the model's own: a greedy row gets exactly the
# tokens it gets one at a time, a sampled row tokens with the same distribution.
#
# This notebook:
#
# 1. writes the lookup by hand and holds `NgramProposer` to it, with a fresh state and with the
#    index a row grows as it decodes,
# 2. writes the acceptance rule by hand against `accepted_length`, and shows on an exact law why
#    drawing a token and comparing it with the draft is speculative sampling, and what two wrong
#    rules do instead,
# 3. runs the real model with and without drafts, greedy: equal tokens, what was proposed and
#    kept, and the same counts replayed from the answer alone,
# 4. plants an off-by-one in the accepted length and watches token equality catch it,
# 5. prices a draft token (`bench.verify_costs`), finds the break-even, and reads the day's
#    table (`days/day68/specbench.py`),
# 6. walks the rule that turns drafting off for a row whose drafts do not pay,
# 7. draws the diagram.
#
# The engine is the one `build_engine` makes for the default model, SmolLM2-135M-Instruct: its
# GGUF's own Q4_1 blocks (day 60), the fused decode step (day 61), decode attention in place
# (day 58), the budget schedule (day 57), and today `speculative="ngram"`, with K 3
# (`num_speculative_tokens`) and n-grams of 2 to 4 tokens (`prompt_lookup_min`,
# `prompt_lookup_max`). It serves with int8 activations; section 3 runs fp32 activations, for a
# reason it gives.

# %%
import random
import re
import sys
import time
from collections import Counter, defaultdict
from fractions import Fraction
from itertools import product, takewhile
from unittest import mock

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

import nanoserve.engine as engine_module
from nanocourse import REPO, diagram_path, read_csv
from nanoserve.bench import cpu_line
from nanoserve.sampling import SamplingParams
from nanoserve.speculative import (
    FIRST_PAUSE,
    MAX_PAUSE,
    WINDOW,
    NgramProposer,
    RowState,
    SpecStats,
    accepted_length,
)

sys.path.insert(0, str(REPO / "days" / "day68"))
import specbench  # the day's script: the notebook calls its functions and reads its tables

print(cpu_line())
T0 = time.perf_counter()

# %% [markdown]
# ## 1. The lookup by hand
#
# A row's context is its prompt and the tokens it has generated. The lookup takes the longest
# n-gram the context ends with, from `prompt_lookup_max` tokens down to `prompt_lookup_min`, that
# also occurs earlier, and proposes the (at most K) tokens that followed its latest earlier
# occurrence. "Earlier" means an occurrence with a token after it; it may overlap the end of the
# context, as in a run of one repeated token. By hand, scanning back from the newest position:

# %%
def lookup_by_hand(tokens, k, min_n, max_n):
    """Up to k tokens that followed the latest earlier occurrence of the longest n-gram (max_n
    tokens down to min_n) that `tokens` ends with; [] when none of them occurred before."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # where an earlier occurrence ends: latest first
            if tokens[end - n : end] == tail:
                return tokens[end : end + k]
    return []


EXAMPLE = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
print(f"{EXAMPLE}: K 3, n-grams of 1 to 3 -> {lookup_by_hand(EXAMPLE, 3, 1, 3)}")
print(f"NgramProposer(3, 1, 3).propose: {NgramProposer(3, 1, 3).propose(RowState(), EXAMPLE, 3)}")

# %% [markdown]
# The context ends in (6, 7). It occurred at positions 1-2, followed by 8, and at 5-6, followed
# by 1, 2, 6: the later one wins (the 3-gram (2, 6, 7) never occurred before, so the 2-gram
# decides). The package does not scan. Each row keeps a dictionary from n-gram to the position
# just after its latest end (`RowState.index`) and, at each step, indexes only the positions
# appended since the last (`RowState.indexed`), so a lookup is a few dictionary reads however
# long the context. That gives two things to hold to the hand version: the lookup itself, with a
# fresh state each call, and the index kept across calls, with one state and the sequence growing
# a token at a time, as a decoding row's does. Random sequences over 2 to 4 symbols, so that
# repeats are common, under four settings of K and the bounds:

# %%
rng = random.Random(68)
SETTINGS = [(3, 2, 4), (1, 1, 1), (5, 1, 3), (3, 3, 5)]  # (K, prompt_lookup_min, prompt_lookup_max)
fresh = grown = found = lookups = sequences = 0
for k, lo, hi in SETTINGS:
    proposer = NgramProposer(k, lo, hi)
    for _ in range(1000):
        seq = [rng.randrange(rng.choice((2, 3, 4))) for _ in range(rng.randrange(1, 41))]
        want = lookup_by_hand(seq, k, lo, hi)
        sequences += 1
        found += bool(want)
        fresh += proposer.propose(RowState(), seq, k) == want
        state = RowState()  # one state, the sequence growing a token at a time, as a row's does
        for end in range(1, len(seq) + 1):
            lookups += 1
            grown += proposer.propose(state, seq[:end], k) == lookup_by_hand(seq[:end], k, lo, hi)
print(f"a fresh RowState each call: {fresh} of {sequences} sequences agree ({found} have a proposal)")
print(f"one RowState grown token by token: {grown} of {lookups} lookups agree")
assert fresh == sequences and grown == lookups

# %% [markdown]
# All 4,000 sequences agree, 2,779 of them with something to propose, and so do all 82,423
# lookups along the grown sequences. The grown check is the one an index that skips a position
# fails while the fresh one mostly passes (Try it 3), and such a bug never shows in the tokens:
# a proposer that misses an n-gram proposes less, the model's tokens stay the model's, and only
# the counts move.
#
# ## 2. The acceptance rule
#
# A row with a draft d1..dK runs K + 1 positions: its newest token and the draft. Position j's
# logits are the model's law for the next token given the context and d1..dj. The engine draws
# one token t_j at every position exactly as it draws a row's token (greedy, temperature, top-k
# and the rest, from the row's own generator), and `accepted_length` keeps the longest prefix
# where t_j equals d_{j+1}. The row gets d1..dm and then t_m: the model's own token at the first
# position that disagreed, or after the last draft token when all were kept. By hand, against the
# package on random cases:

# %%
def accepted_by_hand(draft, drawn):
    """How many draft tokens are kept: the leading positions where the token drawn equals the draft's."""
    return sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1], zip(draft, drawn)))


cases = []
for _ in range(5000):
    draft = [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
    cases.append((draft, [rng.randrange(3) for _ in range(len(draft) + 1)]))
kept = Counter(accepted_by_hand(d, s) for d, s in cases)
assert all(accepted_by_hand(d, s) == accepted_length(d, s) for d, s in cases)
print(f"accepted_length agrees on {len(cases)} of {len(cases)} random cases; "
      f"kept lengths {dict(sorted(kept.items()))}")  # fmt: skip

# %% [markdown]
# **Why this keeps the model's law.** Speculative sampling (Leviathan et al. and Chen et al.,
# 2023) keeps a draft token x, proposed with probability q(x), with probability
# min(1, p(x) / q(x)), and on a refusal draws from max(0, p - q), renormalized. The lookup is
# deterministic: q puts all its mass on the draft token d. The rule then keeps d with
# probability p(d), and the residual is p without d, renormalized. Drawing t from p and keeping d
# when t = d is that rule: d comes out with probability p(d), and any other x with probability
# p(x), which is p(x) / (1 - p(d)) of the refusals. For a greedy row t is the argmax, so a draft
# token is kept exactly when it is the argmax, and the tokens are those of decoding one at a time.
#
# Exactly, in fractions: a model over 6 tokens with a law P1 for the next token and a law after
# each first token (P2, small random integers normalized), and the draft [1], the second likeliest
# token. For each rule, the law of the first token emitted; for the engine's rule (the package's
# `accepted_length` inside the enumeration) and the off-by-one, the law of the first two tokens,
# from the step that verifies the draft and, when it emitted only one, the step after it:

# %%
V = 6
law_rng = random.Random(6)


def normalized(weights):
    return [Fraction(w, sum(weights)) for w in weights]


P1 = normalized([6, 5, 4, 2, 2, 1])  # the model's law for the next token
P2 = {x: normalized([law_rng.randrange(1, 10) for _ in range(V)]) for x in range(V)}  # ... and after x
TRUE = {(a, b): P1[a] * P2[a][b] for a, b in product(range(V), range(V))}


def law_of_two(keep, d):
    """The exact law of the first two tokens a row emits when its first step verifies the draft
    [d] and keeps keep([d], drawn) draft tokens: the step draws t1 from P1 and t2 from the law
    after d; a step that emits one token leaves the second to the next step, which draws it
    from the law after that token."""
    law = defaultdict(Fraction)
    for t1, t2 in product(range(V), range(V)):
        chance = P1[t1] * P2[d][t2]
        m = keep([d], [t1, t2])
        emitted = [d][:m] + [[t1, t2][m]]
        if len(emitted) == 2:
            law[tuple(emitted)] += chance
        else:
            for x2 in range(V):
                law[(emitted[0], x2)] += chance * P2[emitted[0]][x2]
    return law


def first_token(law):
    return [sum(p for (a, _), p in law.items() if a == x) for x in range(V)]


def standard_rule(d):
    """Leviathan et al.'s rule for a proposer that puts all its mass on d: keep d with
    probability min(1, p(d) / 1), else draw from max(0, p - q), renormalized."""
    residual = [P1[x] if x != d else Fraction(0) for x in range(V)]
    rest = sum(residual)
    return [P1[d] * (x == d) + (1 - P1[d]) * residual[x] / rest for x in range(V)]


def half_the_time(d):
    """Planted: keep the draft with probability 1/2, else draw from the model's law."""
    return [Fraction(1, 2) * (x == d) + Fraction(1, 2) * P1[x] for x in range(V)]


real = accepted_length
one_more = lambda draft, drawn: min(len(draft), real(draft, drawn) + 1)  # noqa: E731
for d in range(V):
    assert law_of_two(accepted_length, d) == TRUE and standard_rule(d) == P1
D = 1
rules = {  # each rule's law of the first token emitted
    "draw, compare": first_token(law_of_two(accepted_length, D)),
    "p(d), residual": standard_rule(D),
    "planted: half": half_the_time(D),
    "planted: +1": first_token(law_of_two(one_more, D)),
}
print(f"the first token emitted, the draft being token {D}:")
print(f"{'token':>6} {'the model':>10} " + " ".join(f"{name:>15}" for name in rules))
for x in range(V):
    print(f"{x:>6} {float(P1[x]):>10.3f} " + " ".join(f"{float(law[x]):>15.3f}" for law in rules.values()))
print(f"{'max |difference|':>17} " + " ".join(
    f"{float(max(abs(a - b) for a, b in zip(law, P1))):>15.3f}" for law in rules.values()))  # fmt: skip
both = {"draw, compare": law_of_two(accepted_length, D), "planted: +1": law_of_two(one_more, D)}
for name, law in both.items():
    print(f"{name}: the law of the first two tokens (36 pairs) differs from the model's by at most "
          f"{float(max(abs(law[key] - TRUE[key]) for key in TRUE)):.3f}")  # fmt: skip
assert max(abs(both["planted: +1"][key] - TRUE[key]) for key in TRUE) > 0.1

# %% [markdown]
# Drawing and comparing gives the model's law exactly, for the first token and for the pair, and
# so does the textbook rule with q one-hot: the asserts compare fractions with `==`, for every
# draft token from 0 to 5. The planted rules do not. Keeping the draft half the time, whatever the
# model thinks of it, gives token 1 a probability of 0.625 where the model says 0.25. Keeping one
# token more than agreed, the mistake of section 4, always emits the draft: 1.000 for 0.25, and
# over the pairs it is off by up to 0.176. `tests/test_speculative.py` holds the engine itself to
# the law, with a chi-square over 3,200 sampled triples of a tiny model, and the same off-by-one
# fails it.
# %% [markdown]
# ## 3. The real model
#
# Two engines over the default model's GGUF that differ only in `speculative`, both with
# `quant_activations="fp32"`. The comparison below is token for token, and the arithmetic of a
# step depends a little on its shape: a step that mixes a prompt chunk with decode rows takes
# the torch ops, one without takes the fused call, and their float sums differ in the last bit.
# With fp32 activations that moves a logit by about 1e-6, which can change a greedy token only at
# a near-tie. int8 activations quantize each row per block of 32 and magnify the same difference
# to about 0.1 (the comment on `smollm_engines` in `tests/test_speculative.py`), a net too wide
# to catch a wrong draft with. One row alone never mixes, and the script's int8 runs give equal
# tokens as well (`tokens_equal` in section 5's table); fp32 keeps the comparison a gate.
#
# Two prompts: the day's first "copy" prompt, a function to write out again with `total`
# renamed to `acc`, and its first "free" one, a plain question. Each greedy, at most 128 tokens,
# once through the engine without drafts and once stepped by hand through the one with them,
# noting at each step the draft the proposer returned (`trace`):

# %%
engines = {}
for spec in (None, "ngram"):
    engines[spec], said = specbench.make_engine(spec, activations="fp32")
    specbench.run(engines[spec], ["Hi"], rows=1, max_tokens=4)  # first-call costs, before any timing
print(re.sub(r"(, tiles)?\), [\d.]+ MB,", "),", engines["ngram"].paths_line()))
PROMPTS = {"copy": specbench.WORKLOADS["copy"][0], "free": specbench.WORKLOADS["free"][0]}
COUNTERS = specbench.COUNTERS


def trace(engine, prompt, max_tokens=specbench.MAX_TOKENS):
    """One request stepped by hand through an engine with drafts: (its answer's token ids, for
    every step after the prompt's the draft it verified and the tokens it emitted, seconds)."""
    proposed = []

    def spy(state, tokens, limit, real=engine.proposer.propose):
        draft = real(state, tokens, limit)
        proposed.append(list(draft))
        return draft

    with mock.patch.object(engine.proposer, "propose", spy):
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        engine.add_request([{"role": "user", "content": prompt}], params)
        steps, answer, t0 = [], [], time.perf_counter()
        while engine.has_unfinished():
            proposed.clear()
            for out in engine.step():
                answer += out.new_token_ids
                if proposed:  # a decode step (the prompt's step proposes nothing)
                    steps.append((proposed[-1], out.new_token_ids))
        return answer, steps, time.perf_counter() - t0


RUNS = {}
for name, prompt in PROMPTS.items():
    off = specbench.run(engines[None], [prompt], rows=1)
    before = {k: getattr(engines["ngram"].spec_stats, k) for k in COUNTERS}
    answer, steps, seconds = trace(engines["ngram"], prompt)
    stats = {k: getattr(engines["ngram"].spec_stats, k) - before[k] for k in COUNTERS}
    RUNS[name] = dict(off=off["tokens"][0], on=answer, steps=steps, stats=stats)
    for draft, new in steps:  # what a step emits: the kept draft tokens, then the model's own
        assert new[:-1] == draft[: len(new) - 1]
    n = len(answer)
    n_prompt = len(engines[None].encode_prompt([{"role": "user", "content": prompt}]))
    print(f"{name}: {prompt.splitlines()[0]!r} ({n_prompt} prompt tokens)")
    print(f"  without drafts: {len(off['tokens'][0])} tokens in {len(off['tokens'][0])} steps, "
          f"{len(off['tokens'][0]) / off['seconds']:.1f} tok/s")  # fmt: skip
    print(f"  with drafts:    {n} tokens in {len(steps) + 1} steps, {n / seconds:.1f} tok/s; "
          f"equal to the tokens without: {answer == off['tokens'][0]}")  # fmt: skip
    print(f"  {stats['verifications']} verifications, {stats['draft_tokens']} draft tokens proposed, "
          f"{stats['accepted_tokens']} kept (acceptance rate "
          f"{stats['accepted_tokens'] / stats['draft_tokens']:.3f}), "
          f"{stats['emitted_tokens'] / stats['verifications']:.2f} tokens a verification")  # fmt: skip
    runs = Counter(len(new) - 1 for draft, new in steps if draft)
    print(f"  draft tokens kept, verification by verification: {dict(sorted(runs.items()))}")
    assert answer == off["tokens"][0]
tok = engines[None].tokenizer
print()
print(tok.decode(RUNS["copy"]["on"]))

# %% [markdown]
# The function written out again: 128 tokens in 60 steps instead of 128. The lookup proposed at
# 30 of the steps, 90 tokens, and the model kept 68 of them (0.756); a step that verified a draft
# produced 3.27 tokens on average. Kept tokens come in runs: 21 of the 30 drafts were kept whole,
# 5 were refused at their first token. The model did not rename anything (a 135M model copies the
# code as it was, then describes it), which is the lookup's best case: once the answer enters the
# code, every n-gram of it occurred in the prompt. The plain question gave 101 tokens in 96
# steps: the lookup found something to propose at 8 steps, and they kept 5 of 24 tokens. Both
# answers are token for token the answers without drafts. The rates printed are wall-clock (and
# masked under test); section 5's table has the script's.
#
# **The answer is the whole story.** For a greedy row, a verification keeps the longest prefix of
# its draft that the answer goes on with, and the answer is the same with drafts or without. So a
# proposer can be scored without the model: walk the answer, ask the proposer at each step, keep
# what the answer confirms, and move on by the tokens the step would have emitted (the limit a
# row passes is what it may still generate, less the one token the step always adds):

# %%
def replay(proposer, prompt_ids, answer, max_tokens=specbench.MAX_TOKENS, pauses=None):
    """What `proposer` drafts and keeps along a greedy answer, without the model: each
    verification keeps the longest prefix of its draft that the answer itself continues with
    (SpecStats of the row, as the engine counts them). `pauses`, a list: each pause the row
    takes is appended to it, (tokens of the answer so far, steps)."""
    tokens, state, stats = prompt_ids + answer, RowState(), SpecStats()
    n = len(prompt_ids) + 1  # the prompt's step gives the first token, without a draft
    while n < len(tokens):
        left = max_tokens - (n - len(prompt_ids)) - 1
        draft = proposer.propose(state, tokens[:n], left)
        m = accepted_by_hand(draft, tokens[n:])
        emitted = min(m + 1, len(tokens) - n)
        if draft:
            stats.verifications += 1
            stats.draft_tokens += len(draft)
            stats.accepted_tokens += m
            stats.emitted_tokens += emitted
            proposer.record(state, m, len(draft))
            if state.pause and pauses is not None:
                pauses.append((n - len(prompt_ids), state.pause))
        n += emitted
    return stats


PROMPT_IDS = {
    name: engines[None].encode_prompt([{"role": "user", "content": p}])
    for name, p in PROMPTS.items()
}
for name, run in RUNS.items():
    again = replay(NgramProposer(3, 2, 4), PROMPT_IDS[name], run["on"])
    print(f"{name}: the replay {again.as_dict()}")
    assert {k: getattr(again, k) for k in COUNTERS} == run["stats"]
print("equal to the engine's counters")

# %% [markdown]
# The replay gives the engine's counters exactly, for both answers. Try it 1 and 2 use it to try
# other proposers on the same two answers in milliseconds.
#
# ## 4. A planted off-by-one
#
# `Engine._step_speculative` calls `accepted_length` by the name `engine.py` imported (`from
# nanoserve.speculative import ... accepted_length`), so a patch of
# `nanoserve.speculative.accepted_length` would not reach it; the patch goes on
# `nanoserve.engine.accepted_length`. Planted: keep one draft token more than the model agreed
# with (never more than the draft holds), and run both prompts again:

# %%
with mock.patch("nanoserve.engine.accepted_length", one_more):
    planted = {name: specbench.run(engines["ngram"], [p], rows=1)["tokens"][0] for name, p in PROMPTS.items()}
assert engine_module.accepted_length is accepted_length  # restored
parted = {}
for name, got in planted.items():
    ref = RUNS[name]["off"]
    at = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    parted[name] = at
    print(f"{name}: equal to the tokens without drafts: {got == ref}", end="")
    if at is not None:
        print(f"; they part at token {at}: {tok.decode(ref[max(0, at - 6) : at])!r} then "
              f"{tok.decode(ref[at : at + 3])!r} without drafts, {tok.decode(got[at : at + 3])!r} "
              "with the planted rule")  # fmt: skip
    else:
        print()
assert any(at is not None for at in parted.values()), "the planted off-by-one went unnoticed"

# %% [markdown]
# Both answers leave the one without drafts (tokens counted from 0). The copy answer at token 1:
# the first verification drafted `' is some Python'` from the prompt's "Here is some Python
# code", the model wrote `'s` where the draft said ` is`, and the planted rule kept ` is` anyway.
# The free answer goes on until token 42, where a kept line break starts a third tip one sentence
# early.
# Each mistake then compounds: every later step continues a text the model did not write. Token
# equality with the engine without drafts is the gate, and `tests/test_speculative.py` plants
# the same rule for a tiny model's greedy rows.
#
# ## 5. What a draft token costs
#
# Verifying is not free on a CPU. The weights are read once whatever the step holds, but each
# draft token is one more row of arithmetic through every linear and one more query through
# attention. `bench.verify_costs` times one step of the engine's fused call for 1 and 4 decoding
# rows, each carrying 0, 1 or 3 draft tokens (a row's draft becomes more one-token rows of the
# step: `plan_verify`). The notebook's own run, at 5 repeats, is wall-clock and not compared:

# %%
# NBVAL_IGNORE_OUTPUT
costs = specbench.costs(repeats=5)
step = {(c["rows"], c["draft_tokens"]): c["step_ms"] for c in costs}
for (rows, k), ms in step.items():
    print(f"{rows} {'rows' if rows > 1 else 'row'}, {k} draft {'token' if k == 1 else 'tokens'} each: "
          f"{ms:.1f} ms a step")  # fmt: skip
print(f"3 draft tokens cost more than none, here: {all(step[(r, 3)] > step[(r, 0)] for r in (1, 4))}")

# %%
COSTS = read_csv(specbench.HERE / "day-68-costs.csv")
SPEC = read_csv(specbench.HERE / "day-68-spec.csv")
ratio = {(int(c["rows"]), int(c["draft_tokens"])): float(c["ratio_to_no_draft"]) for c in COSTS}
print("the script's costs (day-68-costs.csv): a step's time over the same step without drafts")
for (rows, k), r in ratio.items():
    print(f"  {rows} {'rows' if rows > 1 else 'row'}, {k} draft {'token' if k == 1 else 'tokens'} each: "
          f"{r:.2f}")  # fmt: skip


def break_even(r, k):
    """The per-token acceptance a at which a draft of k tokens pays for a step that costs r times
    one without: 1 + a + ... + a^k = r (each token kept with probability a, independently)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**j for j in range(k + 1)) < r else (lo, a)
    return (lo + hi) / 2


for k in (1, 3):
    print(f"one row, {k} draft token{'s' if k > 1 else ''}: pays when each is kept with probability "
          f"over {break_even(ratio[(1, k)], k):.2f}")  # fmt: skip

# %% [markdown]
# The script's run (15 repeats, `day-68-costs.csv`): at one row a step took 2.88 ms on this
# machine, with 1 draft token 1.24 times that, with 3 draft tokens 1.76 times, about a quarter of
# a plain step for each draft token. At 4 rows the plain step costs more (5.46 ms) and the drafts
# cost more of it, 1.73 and 2.91 times: 4 rows with 3 draft tokens each are 16 query rows, and
# reading the weights is no longer all the step does.
#
# **The break-even.** If each of k draft tokens is kept with probability a (independently, which
# real drafts are not), a verifying step yields 1 + a + ... + a^k tokens for the price of r plain
# steps, and pays when that is more than r. At one row, by the script's costs, 1 draft token pays
# when it is kept with probability over 0.24, and 3 when each is kept over 0.46. The pause rule's
# `MIN_RATE` of 0.5 over `WINDOW` 8 verifications is that break-even, rounded up (section 6). It
# judges by the rate, the cautious measure: kept tokens come in runs (21 of the copy answer's 30
# drafts were kept whole), since a copy is either being followed or not, and what pays is the
# tokens a verification yields against what it costs, which the table below calls
# `mean_accepted_length`.
#
# The script's table: four prompts a workload, greedy, at most 128 tokens each, at one row and at
# four; `seconds` is the better of two timed runs after an untimed one, prefill included. The
# counters are deterministic; `ratio_to_off` (the plain engine's seconds over this engine's, for
# the same tokens) is a measurement of the script's run:

# %%
print(f"{'workload':<9} {'rows':>4} {'spec':<6} {'tokens':>6} {'ratio_to_off':>12} {'verifications':>13} "
      f"{'draft':>6} {'kept':>5} {'rate':>6} {'mean len':>8} {'equal':>6}")  # fmt: skip
for r in SPEC:
    print(f"{r['workload']:<9} {r['rows']:>4} {r['spec']:<6} {r['tokens']:>6} {r['ratio_to_off']:>12} "
          f"{r['verifications']:>13} {r['draft_tokens']:>6} {r['accepted_tokens']:>5} "
          f"{r['acceptance_rate']:>6} "
          f"{r['mean_accepted_length']:>8} {r['tokens_equal']:>6}")  # fmt: skip

# %% [markdown]
# The copy workload at one row ran 1.56 times as fast: 77 verifications kept 162 of 231 draft
# tokens (0.701), 3.08 tokens a verification. At four rows the same drafts bought almost nothing,
# 1.02: a step of 4 rows with 3 draft tokens each costs 2.91 plain 4-row steps, and a
# verification gives back 3.08 tokens, so the drafts pay for themselves and little more. The free
# workload kept 31 of 99 (0.313), and its ratios, 0.98 and 0.95, say that speculation neither won
# nor lost much there: 33 verifications in 351 tokens are too few to move the total either way.
# Every answer, int8 activations and all, was token for token the answer without drafts.

# %% [markdown]
# ## 6. The pause rule
#
# A row whose drafts are refused pays for every verification and gets nothing back, so the
# proposer judges each row on its own record. `NgramProposer.record` keeps the last `WINDOW` (8)
# verifications' kept and proposed counts; once it has 8 and fewer than `MIN_RATE` (half) of the
# proposed tokens were kept, the row stops proposing for `pause` steps: `FIRST_PAUSE` (8) the
# first time, doubling on each further failure up to `MAX_PAUSE` (256), and back to 8 once a full
# window passes. A step without a verification (nothing found, or paused) is not judged. Driven
# by hand, a row whose lookup always finds a draft:

# %%
def pauses_of(outcomes, k=3):
    """A row whose lookup always finds a draft of k tokens, and whose verifications keep
    outcomes[i] tokens in turn: ([(the verification after which it paused, the pause)], the
    steps it took, the steps at which it verified)."""
    proposer, state = NgramProposer(k, 2, 4), RowState()
    tokens = [1, 2, 3, 1, 2]  # (1, 2) occurred before: a draft every step the row is not paused
    out, step, verified_at = [], 0, []
    while len(verified_at) < len(outcomes):
        step += 1
        if proposer.propose(state, tokens, k):
            proposer.record(state, outcomes[len(verified_at)], k)
            verified_at.append(step)
            if state.pause:
                out.append((len(verified_at), state.pause))
    return out, step, verified_at


hopeless, steps_taken, hopeless_at = pauses_of([0] * (WINDOW * 8))
print(f"keeping nothing: pauses {[p for _, p in hopeless]} after verifications {[v for v, _ in hopeless]}")
print(f"  {WINDOW * 8} verifications over {steps_taken} steps")
assert [p for _, p in hopeless] == [min(FIRST_PAUSE * 2**i, MAX_PAUSE) for i in range(8)]
mixed, _, _ = pauses_of([0] * WINDOW + [0] * WINDOW + [3] * WINDOW + [0] * WINDOW)
print(f"bad, bad, good, bad windows: pauses {[p for _, p in mixed]} "
      f"after verifications {[v for v, _ in mixed]}")  # fmt: skip
assert [p for _, p in mixed] == [FIRST_PAUSE, 2 * FIRST_PAUSE, FIRST_PAUSE]
half, _, _ = pauses_of([2, 1] * (WINDOW * 2))  # 12 of 24 each window: MIN_RATE exactly
print(f"keeping half (2 then 1 of 3): pauses {half}")
assert half == []
for name, run in RUNS.items():
    taken = []
    replay(NgramProposer(3, 2, 4), PROMPT_IDS[name], run["on"], pauses=taken)
    print(f"section 3's {name} answer ({len(run['on'])} tokens): pauses (tokens so far, steps) {taken}")

# %% [markdown]
# A row that keeps nothing is judged after its 8th verification and pauses for 8 steps, then 16,
# 32, 64, 128, and from then on 256: 64 verifications take it 824 steps, and at the cap it
# verifies 8 of every 264 steps, 3% of them, in case the text turns predictable again. A good
# window in between (all 3 of 3 kept) resets the next pause to 8: the third failure pauses for 8,
# not 32. The window slides, so the failure after the good window comes at the 29th verification,
# when 5 bad ones outweigh 3 good ones (9 of 24 kept). Keeping exactly half never pauses: 12 of
# 24 is not fewer than `MIN_RATE`. On section 3's answers the rule fired once, and too late to
# matter: the free answer's 8th verification (5 of 24 kept in its window) came after 97 of its
# 101 tokens. Try it 2 finds an answer where the rule does matter.
#
# ## 7. The diagram

# %%
fig = plt.figure(figsize=(16, 11))
grid = fig.add_gridspec(2, 3, hspace=0.35, wspace=0.35)
KEPT, MODEL, REFUSED = "#6aa84f", "#3d85c6", "#e06666"


def label(t):
    """A token's text as a box shows it: spaces as middle dots, line breaks as arrows."""
    return tok.decode([t]).replace(" ", "\u00b7").replace("\n", "\u21b5")[:10]


def draw_steps(ax, rows, title):
    """One decode step a line, (step number, draft, tokens emitted): the draft tokens kept, the
    model's own token, the draft tokens refused."""
    for y, (_, draft, new) in enumerate(rows):
        m = len(new) - 1
        cells = [(t, KEPT) for t in draft[:m]] + [(new[-1], MODEL)] + [(t, REFUSED) for t in draft[m:]]
        for x, (t, color) in enumerate(cells):
            alpha = 0.35 if color == REFUSED else 0.85
            ax.add_patch(plt.Rectangle((x, -y - 0.9), 0.95, 0.8, color=color, alpha=alpha))
            ax.text(x + 0.47, -y - 0.5, label(t), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, 4)
    ax.set_ylim(-len(rows) - 0.2, 0.2)
    every = 1 if len(rows) <= 12 else 5
    ticks = range(0, len(rows), every)
    ax.set_yticks([-y - 0.5 for y in ticks], [str(rows[y][0]) for y in ticks])
    ax.set_xticks([])
    ax.set_ylabel("decode step")
    ax.set_title(title, fontsize=11)


copy_rows = [(i + 1, d, new) for i, (d, new) in enumerate(RUNS["copy"]["steps"][:36])]
free_rows = [(i + 1, d, new) for i, (d, new) in enumerate(RUNS["free"]["steps"]) if d]
copy_title = "copy: the function written out again,\nits first 36 decode steps"
draw_steps(fig.add_subplot(grid[:, 0]), copy_rows, copy_title)
free_title = (f"free: three tips for studying, the {len(free_rows)} steps\nof {len(RUNS['free']['steps'])} "
              "that verified a draft")  # fmt: skip
draw_steps(fig.add_subplot(grid[0, 1]), free_rows, free_title)

ax = fig.add_subplot(grid[1, 1])
for name, color in (("copy", KEPT), ("free", MODEL)):
    sizes = [len(new) for _, new in RUNS[name]["steps"]]
    reached = [1] + [1 + sum(sizes[: i + 1]) for i in range(len(sizes))]  # the prompt's step gives one
    ax.plot(range(1, len(reached) + 1), reached, color=color, label=f"{name}, with drafts")
n_max = max(len(r["on"]) for r in RUNS.values())
ax.plot([0, n_max], [0, n_max], color="#999999", linestyle="--", label="one token a step")
ax.set_xlabel("steps")
ax.set_ylabel("tokens of the answer")
ax.legend(fontsize=9)
ax.set_title("tokens against steps (weight passes)", fontsize=11)

ax = fig.add_subplot(grid[0, 2])
for rows, color in ((1, "#3d85c6"), (4, "#e69138")):
    ks = sorted(k for r, k in ratio if r == rows)
    label_rows = f"{rows} row{'s' if rows > 1 else ''}"
    ax.plot(ks, [ratio[(rows, k)] for k in ks], marker="o", color=color, label=label_rows)
    for k in ks:
        ax.text(k, ratio[(rows, k)] + 0.05, f"{ratio[(rows, k)]:.2f}", ha="center", fontsize=8)
ax.set_xticks(ks)
ax.set_xlabel("draft tokens a row")
ax.set_ylabel("step time / the step without drafts")
ax.legend(fontsize=9)
ax.set_title("what verifying costs (day-68-costs.csv)", fontsize=11)
ax = fig.add_subplot(grid[1, 2])
ax.step([0] + hopeless_at, range(len(hopeless_at) + 1), where="post", color=REFUSED)
ax.set_xlabel("step")
ax.set_ylabel("verifications so far")
for v, pause in hopeless:
    if pause >= 32 and v < len(hopeless_at):  # the flat stretches long enough to label (the last is cut)
        ax.text(hopeless_at[v - 1] + pause / 2, v + 1.5, str(pause), ha="center", fontsize=9)
pause_title = "the pause rule: a row that keeps nothing verifies 8 times,\nthen pauses 8, 16, 32, ... 256"
ax.set_title(pause_title, fontsize=11)
kinds = [(KEPT, 0.85, "draft token kept"), (MODEL, 0.85, "the model's own token"),
         (REFUSED, 0.35, "draft token refused")]  # fmt: skip
handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=a) for c, a, _ in kinds]
fig.legend(handles, [name for _, _, name in kinds], loc="lower center", ncol=3, fontsize=10)
fig.suptitle("Day 68: speculative decoding by n-gram lookup (SmolLM2-135M-Instruct, greedy, K 3)",
             fontsize=15)  # fmt: skip
png = diagram_path("day68-speculative.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")

# %% [markdown]
# Left, the copy answer's first 36 decode steps, one a line: the draft tokens the model kept
# (green), its own token (blue), and the draft tokens it refused (faded red), spaces shown as
# dots and line breaks as arrows. The first two drafts come from the prompt's sentences and are
# refused; from step 11 the answer is inside the code, and most steps keep all three draft
# tokens and add a fourth.
# Middle top, the free answer's 8 verifications among its 95 decode steps: short drafts from its
# own earlier words, mostly refused. Middle bottom, tokens against steps, each step one pass over
# the weights: the copy answer reaches 128 tokens in 60 steps, the free one runs along the
# one-token-a-step line. Right top, the script's cost of a step with 0, 1 and 3 draft tokens a
# row, against the same step without. Right bottom, section 6's row that keeps nothing: its
# verifications so far against steps, each flat stretch a pause, doubling from 8 to 256.
#
# ## In the real systems
#
# * **vLLM** configures the same proposer with `speculative_config={"method": "ngram",
#   "num_speculative_tokens": K, "prompt_lookup_max": ..., "prompt_lookup_min": ...}`
#   (`--speculative-config` on the server; the bounds' names are vLLM's, which nanoserve took).
#   Its `NgramProposer` (`vllm/v1/spec_decode/ngram_proposer.py`) finds the longest matching
#   n-gram with a KMP-style scan of the reversed context and, in the version we read, drafts
#   from its *earliest* occurrence, where nanoserve takes the latest (Try it 1 compares them on
#   this notebook's answers). Verification is `RejectionSampler`
#   (`vllm/v1/sample/rejection_sampler.py`): greedy rows compare the draft with the argmax, as
#   here; a sampled row's n-gram draft has no probabilities, so the draft token is treated as
#   proposed with probability 1, kept when a uniform draw is at most its target probability,
#   and on a refusal a "recovered" token is drawn from the target law with the draft token
#   zeroed. That is the law of section 2, reached with a uniform and a second draw where
#   nanoserve draws once from p and compares.
# * **llama.cpp**'s `llama-server --spec-type ngram-simple` looks up the last occurrence of the
#   context's final n-gram of one fixed size (`--spec-ngram-size-n`) and drafts the tokens that
#   followed it (`--spec-ngram-size-m`, capped by `--draft-max`); `ngram-map-k`, `ngram-map-k4v`
#   and `ngram-mod` keep statistics or a hash pool of n-grams instead, and a draft model comes
#   with `-md` (`--model-draft`) (`docs/speculative.md` in the version we read). Its verification,
#   `common_sampler_sample_and_accept_n`, samples at each draft position and stops at the first
#   token that differs from the draft: draw and compare, as here.
# * **transformers** does prompt lookup in `generate(..., prompt_lookup_num_tokens=K,
#   max_matching_ngram_size=N)` (`PromptLookupCandidateGenerator` in
#   `generation/candidate_generator.py`): n-grams from N (default 2) down to 1, the first
#   occurrence from the left that has tokens after it, one sequence at a time. Without draft
#   logits, a sampled step draws from the model at every position and keeps the agreeing prefix,
#   the rule of section 2.
# * **SGLang** names its draft-model-free method `--speculative-algorithm NGRAM` (its
#   documentation lists it as CUDA-only), beside `EAGLE`, `EAGLE3` and `STANDALONE` (a small
#   draft model).
# * **Draft models, EAGLE, Medusa.** A draft model is a smaller model with the same tokenizer
#   that writes the K guesses one at a time (vLLM's `speculative_config={"model": ...}`,
#   llama.cpp's `-md`, transformers' `assistant_model=`); its own probabilities q enter the
#   min(1, p / q) rule, so a sampled draft is no longer one-hot. EAGLE (2 and 3) drafts with a
#   small head trained on the target model's hidden states, and Medusa adds decoding heads to the
#   target model that each guess a token further ahead from the same hidden state, the guesses
#   checked together as a tree. Both can guess free text, which a lookup cannot, at the price of
#   a head trained for each model.
# * **When to stop.** TensorRT-LLM's n-gram config has an `acceptance_rate_window_size` and an
#   `acceptance_rate_threshold`: once the rolling acceptance over that window falls below the
#   threshold, speculation is turned off for good. nanoserve's pause is per row and comes back,
#   after 8 steps at first and never more than 256, since a text can turn into a copy at any
#   point (an answer that starts to quote its source).
#
# ## Try it
#
# 1. **The earliest occurrence, as vLLM takes it.** Write `EarliestProposer`, an `NgramProposer`
#    whose `propose` drafts from the earliest earlier occurrence of the longest n-gram instead of
#    the latest (keep the pause: a paused row proposes nothing and counts its pause down). Replay
#    section 3's two answers with it. The check (the cell below holds a solution; replace it with
#    yours): on `EXAMPLE` it drafts `[8, 9, 6]`; on the copy answer it verifies 29 times and keeps
#    69 tokens (the latest: 30 and 68), on the free answer 7 times keeping 6 (the latest: 8 and
#    5). Which one would you ship, and what would it take to know?

# %%
class EarliestProposer(NgramProposer):  # a solution; write yours in its place
    def propose(self, state, tokens, limit):
        if state.pause > 0:
            state.pause -= 1
            return []
        limit = min(self.k, limit)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            for end in range(n, len(tokens)):  # where an earlier occurrence ends: earliest first
                if limit > 0 and tokens[end - n : end] == tokens[-n:]:
                    return tokens[end : end + limit]
        return []


assert EarliestProposer(3, 1, 3).propose(RowState(), EXAMPLE, 3) == [8, 9, 6]
earliest = {name: replay(EarliestProposer(3, 2, 4), PROMPT_IDS[name], r["on"]) for name, r in RUNS.items()}
for name, st in earliest.items():
    print(f"{name}: earliest {st.as_dict()}")
assert (earliest["copy"].verifications, earliest["copy"].accepted_tokens) == (29, 69)
assert (earliest["free"].verifications, earliest["free"].accepted_tokens) == (7, 6)

# %% [markdown]
# 2. **Shorter n-grams, and the judge that stops them.** Replay the free answer with n-grams of
#    1 to 4 (`NgramProposer(3, 1, 4)`), and again with a `NeverPauses` proposer whose `record`
#    does nothing. Predict first: more drafts or fewer, kept more often or less? Then price each
#    run in plain steps with the script's one-row cost of a step with 3 draft tokens: a
#    verification costs that ratio, any other step 1. The check: with the pause, 24 verifications
#    keep 1 of 72 tokens in 100 steps; without it, 41 keep 7 of 123 in 94 steps, and the priced
#    total is higher without the pause than with it, while neither beats the 101 plain steps of
#    decoding without drafts.

# %%
class NeverPauses(NgramProposer):  # a solution; write yours in its place
    def record(self, state, accepted, proposed):
        pass


ids, answer = PROMPT_IDS["free"], RUNS["free"]["on"]
r3 = ratio[(1, 3)]
priced = {}
for name, proposer in (("with the pause", NgramProposer(3, 1, 4)), ("never pausing", NeverPauses(3, 1, 4))):
    st = replay(proposer, ids, answer)
    steps = len(answer) - st.emitted_tokens + st.verifications
    priced[name] = (st.verifications * r3 + steps - st.verifications, st, steps)
    print(f"{name}: {st.verifications} verifications keep {st.accepted_tokens} of {st.draft_tokens} in "
          f"{steps} steps, "
          f"priced {priced[name][0]:.1f} plain steps")  # fmt: skip
with_pause, never = priced["with the pause"], priced["never pausing"]
kept_pause = (with_pause[1].verifications, with_pause[1].accepted_tokens, with_pause[1].draft_tokens)
assert kept_pause + (with_pause[2],) == (24, 1, 72, 100)
assert (never[1].verifications, never[1].accepted_tokens, never[1].draft_tokens, never[2]) == (41, 7, 123, 94)
assert never[0] > with_pause[0] > len(answer)

# %% [markdown]
# 3. **Index one position short.** In `nanoserve/speculative.py`'s `NgramProposer._index`,
#    start the loop one position later: `range(max(state.indexed, self.min_n) + 1, len(tokens))`.
#    Predict which of section 1's two counts notices, and what section 3 prints for each answer,
#    then restart the kernel and rerun the notebook. The check: the cell below, a smaller copy of
#    section 1's, fails, with about half the grown lookups wrong while 290 of the 300 fresh ones
#    still agree; section 3's
#    tokens stay equal and its replay still matches (both use the broken proposer), the free
#    answer gets no draft at all, and the copy answer even looks better (28 verifications keeping
#    69 of 84), since the prompt is indexed whole on the first call and only the answer's own
#    n-grams go missing; and
#    `python -m pytest tests/test_speculative.py -q -k grows` fails. Put the line back.

# %%
check_rng, fresh_ok, grown_ok, total = random.Random(3), 0, 0, 0
for _ in range(300):
    seq = [check_rng.randrange(3) for _ in range(check_rng.randrange(2, 30))]
    fresh_ok += NgramProposer(3, 2, 4).propose(RowState(), seq, 3) == lookup_by_hand(seq, 3, 2, 4)
    state = RowState()
    for end in range(1, len(seq) + 1):
        total += 1
        grown_ok += NgramProposer(3, 2, 4).propose(state, seq[:end], 3) == lookup_by_hand(seq[:end], 3, 2, 4)
print(f"fresh: {fresh_ok} of 300 agree; grown: {grown_ok} of {total} agree")
assert fresh_ok == 300 and grown_ok == total
