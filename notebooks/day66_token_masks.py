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
# # Day 66 — A token mask per step: structured output
#
# A request can ask for JSON that fits a schema (`response_format` with a `json_schema`, or
# vLLM's `guided_json`; `nanoserve/grammar.py` turns either into a `Guided`). The engine cannot
# make a model want to write that JSON. What it can do is refuse: before each token is chosen,
# every token that would take the text off every valid answer gets a logit of -inf, so greedy
# and sampled rows alike can only pick among the rest. The rule fits in a line: token `t` may
# follow the text `p` when `p + text(t)` is still the start of some valid answer, and the end
# token may follow only when `p` is a whole answer.
#
# The refusals are one bit a token: a bitset over the vocabulary, filled a step for each row
# that has a grammar. The grammar library is llguidance (`evals/grammars.py` chose it over
# xgrammar on this CPU); `Grammars.fill` asks it for a step's masks, `apply_mask` writes the
# -inf, and `Engine.step` feeds the chosen token back (`Grammars.advance`). This notebook:
#
# 1. packs and unpacks the bitmask by hand, against `mask_allows` and `apply_mask`,
# 2. writes a tiny schema's mask by hand over SmolLM2's real vocabulary and holds it to
#    llguidance's at every step of every answer, which takes one rule more than the line above,
# 3. runs the engine: a random-weight model that writes noise until the schema constrains it,
#    SmolLM2 itself, the scores of constrained tokens, and the mask without its second rule,
# 4. plants two broken masks in the sampler and watches them caught,
# 5. prices a step's masks against a step's sampling (`days/day66/maskbench.py`),
# 6. draws the diagram.
#
# The engine runs with today's defaults: the budget schedule (day 57), decode attention `auto`
# (day 58's native kernel where it builds), linears `auto` (day 59's packed ones where oneDNN
# can), fp32 weights and K/V, so decode steps run as torch ops (day 61 fuses them only for
# quantized weights). Requests go to `Engine` directly; the server compiles a request's grammar
# on a worker thread before the engine sees it, which this notebook does not need.

# %%
import csv
import json
import math
import os
import random
import sys
import tempfile
import time
import warnings
from collections import Counter
from functools import cache
from pathlib import Path
from unittest import mock

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.bench import cpu_line
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.grammar import JSON_LAYOUT, Guided, apply_mask, mask_allows
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day66"))
sys.path.insert(0, str(REPO))
import maskbench  # the day's script: the notebook calls its functions and reads its table

with warnings.catch_warnings():  # transformers' import warns about tqdm's notebook widgets
    warnings.simplefilter("ignore")
    from tests.test_model import make_tiny_dir, ours_from_dir  # the tests' random checkpoint

torch.manual_seed(0)
print(cpu_line())
WORK = Path(tempfile.mkdtemp(prefix="day66-"))
T0 = time.perf_counter()

# %% [markdown]
# ## 1. The bitmask
#
# SmolLM2's vocabulary has 49,152 tokens, so a row's mask is 49,152 bits: 1,536 int32 words.
# Token `t` is bit `t % 32` of word `t // 32`, the layout llguidance and xgrammar both write and
# `apply_mask` reads. Bit 31 is the sign bit of an int32, so a word whose last token is allowed is
# negative. By hand, for a handful of tokens:

# %%
tok, grammars = maskbench.setup()
V = maskbench.VOCAB
SHIFTS = torch.arange(32, dtype=torch.int32)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """(..., V) bool -> (..., V // 32) int32: bit t % 32 of word t // 32 set where t is allowed."""
    bits = allowed.unflatten(-1, (-1, 32)).to(torch.int64)  # (..., words, 32)
    words = (bits << SHIFTS.to(torch.int64)).sum(-1)  # (..., words), in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits as int32


def unpack(words: torch.Tensor) -> torch.Tensor:
    """(..., words) int32 -> (..., words * 32) bool."""
    return ((words[..., None] >> SHIFTS) & 1).bool().flatten(-2)


some = [0, 31, 32, 1000, V - 1]
allowed = torch.zeros(V, dtype=torch.bool)
allowed[some] = True
row = pack(allowed)
print(f"{V:,} tokens -> {row.numel():,} int32 words = {row.numel() * 4:,} bytes a row "
      f"(a bool a token: {V:,} bytes; an fp32 row of -inf and 0: {V * 4:,} bytes)")  # fmt: skip
for w in sorted({t // 32 for t in some}):
    bits = [t % 32 for t in some if t // 32 == w]
    print(f"  word {w:>4}: bits {bits} -> {int(row[w])}")
assert torch.equal(unpack(row), allowed) and int((row != 0).sum()) == 4
assert all(mask_allows(row, t) for t in some)
assert not any(mask_allows(row, t) for t in range(V) if t not in some)
logits = torch.randn(2, V)
masked = logits.clone()
apply_mask(masked, [1], row[None])  # row 1 masked by it, row 0 untouched
assert torch.equal(masked[0], logits[0]) and torch.isfinite(masked[1]).nonzero().flatten().tolist() == some
print(f"apply_mask leaves {int(torch.isfinite(masked[1]).sum())} finite logits in the masked row, "
      f"{int(torch.isfinite(masked[0]).sum()):,} in the other")  # fmt: skip

# %% [markdown]
# Word 0 holds tokens 0 and 31: 1 + (-2,147,483,648). Word 1535 holds the last token only, bit
# 31 alone, the most negative int32. `mask_allows` reads the same bits, and `apply_mask` keeps
# exactly those 5 logits in the row it masks and leaves the other row alone.
#
# ## 2. A tiny schema's mask by hand
#
# A schema with two required properties, a boolean and one of three numbers, and nothing else.
# The package writes JSON compactly in the schema's order (`grammar.JSON_LAYOUT`: separators
# `", "` and `": "`, no other whitespace), so the language is finite: six strings.

# %%
SCHEMA = maskbench.SCHEMA
ANSWERS = [a.encode() for a in maskbench.ANSWERS]
guided = Guided.json_schema(SCHEMA)
print(json.dumps(SCHEMA))
print(f"layout: {JSON_LAYOUT}")
for a in ANSWERS:
    print(f"  {a.decode()}")
assert ANSWERS == [json.dumps(json.loads(a)).encode() for a in ANSWERS] and len(set(ANSWERS)) == 6

# %% [markdown]
# Every token's text as bytes (`Tokenizer.token_bytes`: SmolLM2 is byte-level, so a token may be
# part of a character; matching on bytes handles that). A special token such as `<|im_end|>` has
# no text in an answer, so it is never allowed as text: its entry is empty. Then the rule of the
# introduction over the whole vocabulary, for any text `p`:

# %%
SPECIAL = sorted(tok.special_ids)
EOS = sorted(tok.eos_ids)
TB = [b"" if t in tok.special_ids else tok.token_bytes(t) for t in range(V)]
ID = {b: t for t, b in enumerate(TB) if b}  # text -> token (one token a text in this vocabulary)
PREFIXES = {a[:i] for a in ANSWERS for i in range(len(a) + 1)}
print(f"{len(SPECIAL)} special tokens (ids {SPECIAL[0]}-{SPECIAL[-1]}), end token {EOS}; {len(ID):,} tokens "
      f"with text, none the same text; {len(PREFIXES)} prefixes of the six answers")  # fmt: skip
assert len(ID) == V - len(SPECIAL)


@cache
def prefix_rule(p: bytes) -> torch.Tensor:
    """(V,) bool: t is allowed after p when p + text(t) starts a valid answer; the end token when
    p is one."""
    allowed = torch.tensor([bool(b) and p + b in PREFIXES for b in TB])
    if p in ANSWERS:
        allowed[EOS] = True
    return allowed


def show(mask: torch.Tensor, n: int = 6) -> str:
    ids = mask.nonzero().flatten().tolist()
    shown = [repr(TB[t].decode()) if TB[t] else f"<end {t}>" for t in ids[:n]]
    return f"{len(ids):>5} allowed: {' '.join(shown)}{' ...' if len(ids) > n else ''}"


m = grammars.matcher(guided)
library = unpack(grammars.fill([m])[0])
print(f"by the rule:  {show(prefix_rule(b''))}")
print(f"llguidance:   {show(library)}")
assert prefix_rule(b"").sum() == 2 and library.nonzero().flatten().tolist() == [ID[b'{"']]

# %% [markdown]
# At the first step they already disagree. Both tokens `{` and `{"` start every answer, and the
# rule allows both; llguidance allows `{"` alone. Nothing is free here: all six answers begin
# `{"ok": `, so the grammar *forces* those bytes. When bytes are forced, llguidance does not offer
# every way of spelling them. It tokenizes them the way the tokenizer would and allows only the
# first of those tokens, so a constrained answer is spelled in the tokens the model saw in
# training (`docs/fast_forward.md` in llguidance: a forced `{` followed by `"` is a pair of tokens
# SmolLM2 has rarely, if ever, seen for `{"`). One refinement keeps that from going too far: the
# last few forced bytes are left to sampling when some token could start inside them and run on
# past their end into what may follow. After `{"ok":` the forced byte is a space, but `" true"`
# and `" false"` are tokens that start with it, so the space is not forced as a token of its own.
#
# So the hand rule has a second part, taken first:
#
# * **forced**: the bytes every answer still reachable from `p` continues with, tokenized with the
#   last token's text in front (a merge can reach back across it), its tail chopped where a
#   token could span the end; if a token is left, it is the only one allowed,
# * **otherwise** the prefix rule.

# %%
MAX_TOKEN_BYTES = max(len(b) for b in ID)


def encode(text: bytes) -> list[int]:
    return tok.encode(text.decode(), add_bos=False)


def forced_bytes(p: bytes) -> bytes:
    """The bytes every valid answer that starts with p continues with (empty where they part)."""
    return os.path.commonprefix([a[len(p) :] for a in ANSWERS if a.startswith(p)])


def spans_the_end(tail: bytes, after: list[bytes]) -> bool:
    """Is there a token tail + x, x non-empty, with x the start of some continuation in after?"""
    return any(tail + c[:k] in ID for c in after for k in range(1, len(c) + 1))


def forced_token(p: bytes, last: int | None) -> int | None:
    """llguidance's forced token after text p, whose last token was `last`; None if none."""
    forced = forced_bytes(p)
    if not forced:
        return None
    ids = encode(TB[last] + forced) if last is not None else []
    ids = ids[1:] if ids[:1] == [last] else encode(forced)  # the last token's text as context
    after = [a[len(p) + len(forced) :] for a in ANSWERS if a.startswith(p + forced)]
    tail = b"".join(TB[t] for t in ids[-4:])[-MAX_TOKEN_BYTES:]
    for i in range(len(tail)):  # the longest tail a token could run past the end from
        if spans_the_end(tail[i:], after):
            chopped = 0
            while chopped < len(tail) - i:  # drop whole tokens until the tail is left to sampling
                chopped += len(TB[ids.pop()])
            break
    return ids[0] if ids else None


def by_hand(p: bytes, last: int | None) -> torch.Tensor:
    """The mask after text p (last token `last`), packed as the engine's bitmask row."""
    forced = forced_token(p, last)
    if forced is None:
        return pack(prefix_rule(p))
    only = torch.zeros(V, dtype=torch.bool)
    only[forced] = True
    return pack(only)


# %% [markdown]
# Now both, step by step: a fresh matcher is fed an answer's tokens one at a time, and before
# each token and after the last, the library's mask row (`Grammars.fill`) must equal the hand's,
# word for word. The answers are each written three ways: as the tokenizer spells them, one byte
# a token (every ASCII character is a token of its own here), and along 40 random walks that
# pick any token the library's mask allows until the end token.

# %%
def walk(ids: list[int], seen: dict) -> list[dict]:
    """Feed ids to a fresh matcher, holding the library's mask to the hand's at every step;
    records in `seen` which mask each text got. One dict a step."""
    m, p, last, steps = grammars.matcher(guided), b"", None, []
    for t in ids + [None]:
        theirs = grammars.fill([m])[0]  # (1536,) int32
        mine = by_hand(p, last)
        assert torch.equal(mine, theirs), (p, last)
        seen.setdefault(p, set()).add(theirs.numpy().tobytes())
        forced = forced_token(p, last)
        steps.append({"p": p, "allowed": unpack(theirs), "rule": prefix_rule(p), "forced": forced})
        if t is None:
            break
        assert grammars.advance(m, t) is None  # the matcher takes every token of every path
        p, last = p + TB[t], t
    assert p in ANSWERS
    return steps


rng = random.Random(maskbench.SEED)
seen, paths = {}, {"the tokenizer's": [], "a byte a token": [], "random walk": []}
for a in ANSWERS:
    paths["the tokenizer's"].append(walk(encode(a), seen))
    paths["a byte a token"].append(walk([ID[bytes([c])] for c in a], seen))
for _ in range(40):
    m, ids = grammars.matcher(guided), []
    while True:
        t = rng.choice(unpack(grammars.fill([m])[0]).nonzero().flatten().tolist())
        if t in EOS:
            break
        grammars.advance(m, t)
        ids.append(t)
    paths["random walk"].append(walk(ids, seen))
for name, ps in paths.items():
    lengths = sorted({len(s) - 1 for s in ps})
    print(f"{name:>16}: {len(ps):>2} paths of {lengths} tokens, {sum(len(s) for s in ps):>3} steps, "
          f"hand == library at every one")  # fmt: skip
reached = Counter(s[-1]["p"].decode() for s in paths["random walk"])
print(f"{sum(len(s) for ps in paths.values() for s in ps)} steps in all; the random walks ended on "
      f"{len(reached)} answers; {len(seen)} texts met, each with one mask whichever tokens wrote "
      f"it")  # fmt: skip
assert all(len(masks) == 1 for masks in seen.values()) and len(reached) == 6

# %% [markdown]
# Hand and library agree on all 724 steps. The byte-a-token paths are tokenizations the
# library's own masks would never produce (`{` is refused at the first step), yet the matcher
# takes them, and the masks along them still follow the two rules; wherever two paths reach the
# same text, they get the same mask.
#
# Along the first answer as the tokenizer spells it, what each step allows:

# %%
STEPS = paths["the tokenizer's"][0]
print(f"{'text so far':<26} {'rule 1':>6}  {'llguidance':<48} forced")
for s in STEPS:
    f = repr(TB[s["forced"]].decode()) if s["forced"] is not None else "-"
    print(f"{s['p'].decode()!r:<26} {int(s['rule'].sum()):>6}  {show(s['allowed'], 4):<48} {f}")
choices = sum(int(s["allowed"].sum()) > 1 for s in STEPS)
print(f"{len(STEPS)} steps, {choices} with a choice, {len(STEPS) - choices} with one token allowed")

# %% [markdown]
# Of the 12 steps of `{"ok": true, "n": 1}`, 2 are choices: after `{"ok":`, where 10 tokens
# start a space and a boolean (`' '`, `' t'`, `' true'`, `' f'`, ...), and after `"n": `, one of
# three digits. The other 10 allow one token each: 9 forced ones and, at the end, the end token.
# At the forced steps the first rule alone allows 1 or 2 tokens (`{` or `{"`, `o` or `ok`, `"`
# or `":`); the second picks the one the tokenizer would write.
#
# ## 3. Through the engine
#
# First a model that knows nothing: the tests' tiny random checkpoint (`make_tiny_dir`: 3
# blocks, hidden 64, random weights) made as wide as SmolLM2's vocabulary, with SmolLM2's
# tokenizer. Without a grammar it writes noise:

# %%
make_tiny_dir(WORK / "tiny", seed=5, vocab_size=V)
noise = ours_from_dir(WORK / "tiny")
per_block = noise.cfg.kv_bytes_per_token(noise.dtype) * 16
engine = Engine(noise, tok, EngineConfig(max_batch=8, kv_budget=per_block * 256))
PROMPTS = ["Is it ok? Answer in JSON.", "Pick n from 1 to 3.", "JSON, please."]
for c in engine.generate(PROMPTS, SamplingParams(max_tokens=12), use_tqdm=False):
    print(f"{c.finish_reason:<6} {c.text!r}")

# %% [markdown]
# With the schema, greedy and sampled at temperature 1 with eight seeds, the same three prompts:

# %%
def finals(engine, params):
    """Each prompt with each params, all at once through the engine: every request's last output,
    with its tokens (`token_ids`) and their text (`text`) gathered."""
    rids = [engine.add_request(p, sp) for sp in params for p in PROMPTS]
    tokens, last = {r: [] for r in rids}, {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                last[o.request_id] = o
    for r in rids:
        last[r].token_ids, last[r].text = tokens[r], tok.decode(tokens[r])
    return [last[r] for r in rids]


def constrained(engine, seeds=range(8)):
    """Greedy, then sampled at temperature 1 with each seed: each prompt, under the schema."""
    params = [SamplingParams(max_tokens=30, guided=guided)]
    params += [SamplingParams(max_tokens=30, temperature=1.0, seed=s, guided=guided) for s in seeds]
    return finals(engine, params)


answers = constrained(engine)
for c in answers:
    assert c.finish_reason == "stop" and c.text.encode() in ANSWERS and json.loads(c.text) is not None
got = Counter(c.text for c in answers)
print(f"{len(answers)} answers, all finished by the end token, all one of the six:")
for a in maskbench.ANSWERS:
    print(f"  {a}  x {got[a]}")
spelled = Counter(tuple(TB[t].decode() for t in c.token_ids if t not in EOS) for c in answers)
for ids, n in spelled.most_common(2):
    print(f"  {n:>2} spelled {list(ids)}")
lengths = sorted(Counter(len(c.token_ids) for c in answers).items())
print(f"(tokens an answer, the end token included, how many): {lengths}")
assert len(got) == 6 and all(c.token_ids[0] == ID[b'{"'] for c in answers)

# %% [markdown]
# Every answer parses and is one of the six, and the rows reach all six. Where bytes are forced
# the answers are spelled as the tokenizer spells them (every one starts with `{"`); at the
# choice after `{"ok":` the random model takes whatever the mask leaves, `' fa'` then a forced
# `l` and `se`, or `' '` then `tr` and `ue`, 12 or 13 tokens and the end token.
#
# SmolLM2-135M-Instruct itself, asked in a chat turn, greedy, once free and once with the schema:

# %%
smol = load_model(fetch_default_model())
pool = smol.cfg.kv_bytes_per_token(smol.dtype) * 16 * 32  # 32 blocks of 16 tokens
chat = Engine(smol, tok, EngineConfig(max_batch=2, max_model_len=256, kv_budget=pool))
ask = tok.encode_chat([{"role": "user", "content": 'Is the sky blue? Reply in JSON with a boolean "ok" '
                        'and a number "n" from 1 to 3.'}])  # fmt: skip
(free,) = chat.generate([ask], SamplingParams(max_tokens=12), use_tqdm=False)
(held,) = chat.generate([ask], SamplingParams(max_tokens=30, guided=guided), use_tqdm=False)
print(f"free:        {free.text!r} ({free.finish_reason})")
print(f"with schema: {held.text!r} ({held.finish_reason}), spelled "
      f"{[TB[t].decode() for t in held.token_ids[:-1]]} and the end token")  # fmt: skip
assert held.text.encode() in ANSWERS and held.finish_reason == "stop"
del chat, smol

# %% [markdown]
# Left alone, the model starts a JSON object of its own design; held by the mask it answers with
# one of the six. At the choice after `{"ok":` it took `' '` and then `'true'`, where the tokenizer
# writes `' true'`: at a choice every spelling the mask allows is the model's to pick.
#
# **The scores stay the model's.** A constrained token's `logprobs` is what the model gave it,
# not renormalized over the allowed tokens (vLLM reports them the same way). Scored again as a
# prompt (`prompt_logprobs`) with no grammar, the same tokens must get the same numbers:

# %%
def run(ids, params):
    rid = engine.add_request(ids, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


prompt = tok.encode(PROMPTS[0])
outs = run(prompt, SamplingParams(max_tokens=30, logprobs=0, guided=guided))
tokens = [t for o in outs for t in o.new_token_ids]
scored = [s.logprob for o in outs for s in o.logprobs]
(first,) = run(prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=0))[:1]
raw = [s.logprob for s in first.prompt_logprobs[len(prompt) :]]
gap = max(abs(a - b) for a, b in zip(scored, raw))
print(f"{len(tokens)} constrained tokens, scores from {min(scored):.2f} to {max(scored):.2f} "
      f"(log(1 / {V:,}) = {-math.log(V):.2f}); scored again unconstrained: "
      f"max |difference| {gap:.1e}")  # fmt: skip
assert len(raw) == len(tokens) and gap < 1e-4 and max(scored) < -5

# %% [markdown]
# The random model spreads its probability almost evenly, about 1 / 49,152 a token (-10.80), forced
# or not, and that is what is reported; renormalized over a mask of one, a forced token would
# score 0.
#
# **Without the second rule.** The engine's masks replaced by the prefix rule alone (the hand's
# function; `Grammars.fill` and `Grammars.advance` patched to keep each row's text):

# %%
texts = {}  # id(matcher) -> the text its row has written


def new_matcher(g):
    m = type(grammars).matcher(grammars, g)
    texts[id(m)] = b""
    return m


def advance_keeping_text(matcher, token):
    texts[id(matcher)] += TB[token]
    return type(grammars).advance(matcher, token)


def fill_by_rule_1(matchers):
    return pack(torch.stack([prefix_rule(texts[id(m)]) for m in matchers]))


patched = dict(matcher=new_matcher, advance=advance_keeping_text, fill=fill_by_rule_1)
with mock.patch.multiple(engine.grammars, **patched):
    loose = constrained(engine)
assert all(c.finish_reason == "stop" and c.text.encode() in ANSWERS for c in loose)
mean = lambda cs: sum(len(c.token_ids) for c in cs) / len(cs)  # noqa: E731
starts = Counter(TB[c.token_ids[0]].decode() for c in loose)
print(f"rule 1 alone: {len(loose)} answers, all one of the six; {mean(loose):.1f} tokens an answer "
      f"against {mean(answers):.1f} with llguidance's masks; first tokens {dict(starts)}")  # fmt: skip

# %% [markdown]
# The prefix rule alone is enough for valid answers: all 27 are one of the six. What it does not
# do is spell them the way text is spelled. The random model starts with `{` 16 times and with
# `{"` 11 times, and the answers grow from 13.3 tokens to 16.1. A trained model would go on
# reading its own answer in token sequences it has hardly met. So the second rule is about the
# model's distribution, and it saves steps: every forced token is still a decode step the row
# pays for (this engine does not skip forced text; "In the real systems" names engines that do).
#
# ## 4. Two broken masks, caught
#
# Two mistakes a hand-written bitmask could make, each planted in the sampler for a run
# (`nanoserve.grammar.apply_mask`, which `sample_rows` calls, wrapped to change the mask first):
# the bits of each word in the wrong order (most significant first), and every bit one token
# off (token `t + 1`'s bit read as token `t`'s).

# %%
def reversed_bits(bitmask):
    return pack(unpack(bitmask).unflatten(-1, (-1, 32)).flip(-1).flatten(-2))


def one_token_off(bitmask):
    return pack(unpack(bitmask).roll(-1, -1))


for name, broken in [("bits reversed in each word", reversed_bits), ("one token off", one_token_off)]:
    first_mask = grammars.fill([grammars.matcher(guided)])  # (1, 1536)
    wrong = unpack(broken(first_mask)[0])
    differs = int((wrong ^ unpack(by_hand(b"", None))).sum())
    planted = lambda lg, rows, bm, f=broken: apply_mask(lg, rows, f(bm))  # noqa: E731
    with mock.patch("nanoserve.grammar.apply_mask", planted):  # sample_rows imports it at each call
        params = [SamplingParams(max_tokens=30, temperature=t, seed=1, guided=guided) for t in (0, 1)]
        outs = finals(engine, params)
    valid = sum(o.finish_reason == "stop" and o.text.encode() in ANSWERS for o in outs)
    reasons = Counter(o.finish_reason for o in outs)
    print(f"{name}: the first step allows {show(wrong, 2).strip()} ({differs} bits differ from the hand's)")
    print(f"   {len(outs)} requests, greedy and sampled: {dict(reasons)}, {valid} valid answers; "
          f"the first error begins {outs[0].error.splitlines()[0]!r}")  # fmt: skip
    assert valid == 0 and reasons == {"error": len(outs)} and differs == 2

# %% [markdown]
# Both are caught twice. Against the hand's mask the first step already differs in 2 bits: the
# planted mask allows one token, the wrong one, and not `{"`. Through the engine no request gets
# an answer at all: the sampler picks the one token the broken mask leaves, the row's matcher
# refuses it (`Grammars.advance` reports a refusal rather than hiding it), and the row ends with
# `finish_reason` "error" and that sentence. A mask and a grammar that disagree cannot produce
# text here; the check that catches a broken mask is the matcher the engine feeds every token to.
#
# ## 5. What a step's masks cost
#
# A row with a grammar costs two things a step: llguidance fills its mask, and the sampler
# writes the -inf. `maskbench.cost_rows` times both for 16 rows on SmolLM2's vocabulary, next to
# `sample_rows` for 16 greedy rows, the whole of what a plain step spends choosing tokens. The
# masks are filled in three states: forced (one token allowed), a choice (ten), and inside a
# JSON string, where almost everything is allowed. Here it runs at 5 repeats (timings vary from
# run to run and are printed for reading, not checked); the table below it is the committed CSV
# of the script's full run, 200 repeats.

# %%
quick = maskbench.cost_rows(repeats=5)
with open(maskbench.HERE / "day-66-cost.csv") as f:
    COST = list(csv.DictReader(f))
fixed = ("op", "variant", "rows", "vocab", "allowed")
assert [{k: str(r[k]) for k in fixed} for r in quick] == [{k: r[k] for k in fixed} for r in COST]
print("this run, 5 repeats:")
for r in quick:
    print(f"  {r['op']:<12} {r['variant']:<30} {r['allowed']:>6} allowed  {r['median_us']:.0f} µs")

# %%
print(f"the committed CSV, {COST[0]['repeats']} repeats ({COST[0]['cpu']}):")
print(f"  {'op':<12} {'variant':<30} {'allowed':>7} {'median, 16 rows':>16} {'a row':>9}")
for r in COST:
    print(f"  {r['op']:<12} {r['variant']:<30} {int(r['allowed']):>7,} {float(r['median_us']):>13,.1f} us "
          f"{float(r['per_row_us']):>7.2f} us")  # fmt: skip
cost = {(r["op"], r["variant"]): float(r["median_us"]) for r in COST}
with open(REPO / "days" / "day61" / "day-61-fused.csv") as f:  # day 61's decode steps of SmolLM2
    step = ("fp32", "16", "ops")
    step_ms = next(float(r["step_ms"]) for r in csv.DictReader(f)
                   if (r["weights"], r["rows"], r["step"]) == step)  # fmt: skip
plain = cost[("sample_rows", "greedy, no masks")]
print(f"fill inside a string / sample_rows without masks: {cost[('fill', 'inside a string')] / plain:.2f}; "
      f"forced: {cost[('fill', 'forced')] / plain:.2f}")  # fmt: skip
slower = cost[("apply_mask", "torch ops")] / cost[("apply_mask", "native kernel")]
print(f"apply_mask, torch ops / native kernel: {slower:.1f}")
print(f"day 61's fp32 decode step at 16 rows, torch ops: {step_ms} ms = "
      f"{step_ms * 1e3 / cost[('fill', 'inside a string')]:.0f} x the string masks' fill")  # fmt: skip

# %% [markdown]
# (The committed table is read from the file, so its figures print the same every run; `us`
# stands for µs there.)
#
# In the script's run, llguidance filled 16 forced masks in 355.9 µs, 22.25 µs a row, about what
# it took for the ten-token choice, and 16 masks inside a string in 4,014.8 µs, 250.92 µs a row: a
# nearly full mask walks most of the token trie. Asked again in the same state, the same
# matchers answered in 40.0 µs from the mask they keep, which is why every timed fill gets fresh
# matchers. Writing the -inf took the native kernel 169.1 µs for 16 rows and torch's unpacked
# bits 2,220.5 µs, 13.1 times longer. Choosing 16 greedy tokens took `sample_rows` 2,133.3 µs
# without masks and 2,086.9 µs with every row masked: the masking is lost in the run-to-run
# noise of the argmax. So a step of 16 rows inside JSON strings spends 1.88 times a plain step's
# sampling on filling masks, forced rows 0.17 times, and both are small beside the step itself:
# day 61's fp32 decode step at 16 rows took 47.09 ms, 12 times the string masks' fill.
#
# ## 6. The diagram

# %%
fig = plt.figure(figsize=(16, 10.5))
grid = fig.add_gridspec(2, 2, hspace=0.4, wspace=0.25)

ax = fig.add_subplot(grid[0, 0])
xs = range(len(STEPS))
ax.bar([x - 0.2 for x in xs], [int(s["rule"].sum()) for s in STEPS], 0.4, color="#999999",
       label="rule 1 alone")  # fmt: skip
ax.bar([x + 0.2 for x in xs], [int(s["allowed"].sum()) for s in STEPS], 0.4, color="#e69138",
       label="llguidance (= by hand)")  # fmt: skip
ax.set_xticks(list(xs), [s["p"].decode()[-6:] or "(start)" for s in STEPS], rotation=60, fontsize=8)
ax.set_yscale("log")
ax.set_ylabel("tokens allowed (of 49,152)")
ax.set_xlabel("the text so far (its last 6 characters)")
ax.legend(fontsize=9)
ax.set_title('allowed tokens at each step of {"ok": true, "n": 1}\n'
             "as the tokenizer spells it", fontsize=11)  # fmt: skip

ax = fig.add_subplot(grid[0, 1])
string_state = unpack(grammars.fill(maskbench.matchers_at(grammars, tok, "inside a string", 1))[0])
rows_shown = [(s["p"].decode()[-10:] or "(start)", s["allowed"]) for s in STEPS]
rows_shown.append(('{"name": "  (a string)', string_state))
for y, (_, mask) in enumerate(rows_shown):
    ids = mask.nonzero().flatten()
    dense = len(ids) > 100
    ax.scatter(ids, [y] * len(ids), s=60 if dense else 14, color="#999999" if dense else "#e69138",
               marker="|" if dense else "o", linewidths=0.3 if dense else None)  # fmt: skip
ax.set_yticks(range(len(rows_shown)), [label for label, _ in rows_shown], fontsize=8)
ax.invert_yaxis()
ax.set_xlim(0, V)
ax.set_xlabel("token id (bit t % 32 of word t // 32)")
ax.set_title("the mask rows as bits over the vocabulary: one dot a set bit;\n"
             f"bottom, inside a JSON string ({int(string_state.sum()):,} set)", fontsize=11)  # fmt: skip

ax = fig.add_subplot(grid[1, 0])
order = [(r["op"], r["variant"]) for r in COST]
ys = range(len(order))
colors = ["#e69138"] * 4 + ["#6fa8dc"] * 2 + ["#999999"] * 2
ax.barh(list(ys), [cost[k] for k in order], color=colors)
for y, k in zip(ys, order):
    ax.text(cost[k] * 1.1, y, f"{cost[k]:,.0f}", va="center", fontsize=8)
ax.set_yticks(list(ys), [f"{op}: {v}" for op, v in order], fontsize=8)
ax.invert_yaxis()
ax.set_xscale("log")
ax.set_xlim(10, 30000)
ax.set_xlabel("µs for 16 rows of 49,152 (median, day-66-cost.csv)")
ax.set_title("what a step's masks cost: fill (llguidance), apply_mask,\nagainst choosing 16 greedy tokens",
             fontsize=11)  # fmt: skip

ax = fig.add_subplot(grid[1, 1])
labels = maskbench.ANSWERS
ax.barh(range(6), [got[a] for a in labels], 0.4, color="#e69138", label="llguidance's masks")
loose_got = Counter(c.text for c in loose)
ax.barh([y + 0.4 for y in range(6)], [loose_got[a] for a in labels], 0.4, color="#999999",
        label="rule 1 alone")  # fmt: skip
ax.set_yticks([y + 0.2 for y in range(6)], labels, fontsize=9, family="monospace")
ax.invert_yaxis()
ax.set_xlabel(f"answers of the random-weight model ({len(answers)} requests: greedy and 8 seeds x 3 prompts)")
ax.legend(fontsize=9, loc="lower right")
ax.set_title(f"noise held to the schema: every answer one of the six\n({mean(answers):.1f} tokens an "
             f"answer; rule 1 alone {mean(loose):.1f})", fontsize=11)  # fmt: skip

fig.suptitle("Day 66: a token mask per step (structured output)", fontsize=15)
png = diagram_path("day66-token-masks.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")

# %% [markdown]
# ## In the real systems
#
# * **vLLM** calls it structured outputs. A request's constraint is a `StructuredOutputsParams`
#   (`structured_outputs` in `SamplingParams`: `json`, `regex`, `choice`, `grammar`,
#   `json_object`, `structural_tag`; its OpenAI server took them as `guided_json`,
#   `guided_regex`, `guided_choice` and `guided_grammar` before, the fields nanoserve reads, and
#   as `response_format`). `StructuredOutputManager` (`vllm/v1/structured_output/__init__.py`)
#   compiles grammars on a thread pool, through one of four backends: `backend_xgrammar.py`,
#   `backend_guidance.py` (llguidance), `backend_outlines.py` and
#   `backend_lm_format_enforcer.py`. Each step, `EngineCore.step` starts the forward and, while
#   it runs, asks the scheduler for the structured rows' bitmask (`get_grammar_bitmask`); the
#   model runner then writes the -inf with `apply_grammar_bitmask`
#   (`vllm/v1/structured_output/utils.py`), through xgrammar's `apply_token_bitmask_inplace`
#   whatever the backend: the same int32 layout as ours, one bit a token.
#   `disable_any_whitespace` is its answer to the whitespace problem our `JSON_LAYOUT` avoids by
#   allowing none.
# * **llama.cpp** constrains with GBNF grammars (`grammars/README.md`); a JSON schema is turned
#   into one by `json_schema_to_grammar` (`common/json-schema-to-grammar.cpp`), which
#   `llama-server` does for `json_schema` and `response_format`. There is no bitmask: the grammar
#   sampler (`llama_sampler_init_grammar`; the grammar in `src/llama-grammar.cpp`) walks each
#   candidate token's text through the grammar's stacks and sets refused ones to -inf. And it checks lazily:
#   `common_sampler_sample` samples first without the grammar, checks the one chosen token, and
#   only if the grammar refuses it applies the grammar to every candidate and samples again
#   (`grammar_first` turns that off). Built with `LLAMA_LLGUIDANCE`, a grammar that starts with
#   `%llguidance` goes to llguidance instead.
# * **SGLang** picks a grammar backend with `--grammar-backend` (xgrammar by default,
#   llguidance, outlines; `python/sglang/srt/constrained/`). SGLang brought *jump-forward*
#   decoding with its compressed finite-state machines (`jump_forward.py`,
#   `outlines_jump_forward.py` there; llguidance's `docs/fast_forward.md` credits it and Guidance
#   with the idea): when the grammar forces a run of text, append it in one go and prefill it,
#   instead of a decode step a token. Our engine pays a decode step for each of the 9 forced
#   tokens of section 2's answer.
# * **llguidance** itself is an Earley parser over a lexer built from derivatives of regular
#   expressions (`derivre`); a mask is a walk of the token trie (`toktrie`) in which each byte
#   is pushed through the lexer and parser and a subtree is skipped at the first refused byte.
#   Its "slicer" (`parser/src/earley/slicer.rs`, `docs/optimizations.md`) splits the vocabulary
#   into slices by regular expressions such as JSON string characters, so a mask inside a string
#   adds whole precomputed slices instead of walking them. The forced-token rule of section 2 is
#   `TokenParser::ff_tokens` and `TokTrie::chop_tokens`, explained in `docs/fast_forward.md`.
#
# Where nanoserve differs: it has one backend, chosen by measurement (`evals/grammars.csv`), and
# fills masks on the engine thread each step (llguidance's own threads, `LLExecutor`), where vLLM
# overlaps the filling with the model's forward. It does not fast-forward forced tokens, and it
# has no lazy check in the style of llama.cpp: every grammar row is masked before it is sampled.
#
# ## Try it
#
# 1. **A third property.** Add `"tag": {"enum": ["a", "b"]}` to `SCHEMA` (in `maskbench.py`),
#    required, make `ANSWERS` the twelve `json.dumps({"ok": ok, "n": n, "tag": t})`, and change
#    the two 6s in section 2's asserts to 12. Rerun sections 1 and 2. The check: the hand's mask
#    still equals llguidance's on every path, the random walks end on all 12 answers, and
#    `forced_bytes(b'{"ok": true, "n": 1')` is now `b', "tag": "'`.
# 2. **Break the chop.** In `forced_token`, replace the loop over `tail` by nothing (force every
#    forced byte as tokens, whatever could follow). Predict the first text at which the hand and
#    the library part, then rerun section 2. The check: the `assert` in `walk` fails at
#    `p == b'{"ok":'`, where the hand forces `' '` alone and llguidance allows 10 tokens (`' t'`,
#    `' true'`, ...); put the loop back and it passes.
# 3. **Mask the other way round.** In `nanoserve/grammar.py`'s `apply_mask`, the torch ops
#    after the native kernel, change `masked_fill(~allowed, ...)` to `masked_fill(allowed, ...)`:
#    keep the refused tokens and drop the allowed ones. Predict which tests notice, with the
#    native kernel off. The check: `NANOSERVE_NATIVE=0 python -m pytest tests/test_grammar.py -q
#    -k "apply_mask or noise"` fails 5 tests, `test_apply_mask_writes_minus_inf_where_a_bit_is_clear`
#    for all three vocabularies and the two whose noise is constrained (every row ends in
#    "error" at its first token, as in section 4); put the `~` back and all 5 pass.
