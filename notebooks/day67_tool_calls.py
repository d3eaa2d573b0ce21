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
# # Day 67 — Tool calls through a chat template
#
# OpenAI's chat API lets a request offer the model functions. The request carries `tools` (each
# a name, a description and a JSON schema of its arguments) and `tool_choice` ("auto", "none",
# "required", or one function by name); the answer may carry `message.tool_calls` (each an id, a
# name and the arguments as a JSON string) and `finish_reason: "tool_calls"`; the client runs the
# functions and sends the results back as `tool` messages, and the model answers again.
#
# Almost none of this reaches the engine. A tool call is text: the chat template writes the
# functions into the prompt, the model writes a call in the format its template taught it, and
# the server reads the call back out of the text. (Only "required" and a named function reach
# the engine, as a grammar.) Qwen2.5's format, shared with Hermes-style models:
#
#     <tool_call>
#     {"name": "get_weather", "arguments": {"city": "Paris"}}
#     </tool_call>
#
# This notebook follows a call through the pieces that make it, on Qwen2.5-Coder-0.5B-Instruct:
#
# 1. what the template does with `tools`: the prompt the model sees, and what the server
#    answers when a model's template has no tools,
# 2. reading calls back out of an answer: a parser by hand against `parse_tool_calls`, and the
#    streamed version, `ToolCallStream`,
# 3. the real model through the server: left free ("auto"), made to call ("required", a Lark
#    grammar in llguidance, day 66's token mask), made to call one function, and the round trip
#    with the function's result,
# 4. two mistakes planted and caught: the grammar spelling `<tool_call>` as text, and a stream
#    that lets a partial tag out,
# 5. the benchmark: 15 prompts, "auto" against "required" (`days/day67/toolbench.py`),
# 6. the diagram.
#
# The engine is the one `build_engine` makes for this model today: its GGUF's own quantized
# blocks with int8 activations (day 60), the fused decode step (day 61), decode attention in
# place (day 58), the budget schedule (day 57), and prefix caching (day 19), which matters here:
# every request of a conversation with tools starts with the same few hundred tokens.

# %%
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import httpx
import jsonschema
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, read_csv, served
from nanoserve.bench import cpu_line
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.grammar import Guided
from nanoserve.models import load_model
from nanoserve.sampling import InvalidParam
from nanoserve.tokenizer import Tokenizer
from nanoserve.tools import ToolCallStream, check_tools, parse_tool_calls, tool_grammar
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day67"))
import toolbench  # the day's script: the notebook calls its functions and reads its tables

print(cpu_line())
T0 = time.perf_counter()
engine, said = toolbench.make_engine()
tok = engine.tokenizer
print(re.sub(r", [\d.]+ MB,", ",", engine.paths_line()))  # the bytes depend on the CPU's kernel layout
print(f"Qwen2.5-Coder-0.5B-Instruct loaded in {time.perf_counter() - T0:.1f} s")
HTTP = httpx.Client(timeout=300)


def shown(obj, indent=1):
    """JSON to print, with the call ids (call_ and 24 random hex digits) masked."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    return re.sub(r"call_[0-9a-f]{24}", "call_" + "x" * 24, text)




# %% [markdown]
# ## 1. What the template does with `tools`
#
# Two functions in OpenAI's shape, `get_weather` and `get_time` (the first two of the day's
# three, `toolbench.TOOLS`), and one user message. `Tokenizer.apply_chat_template` hands
# `tools` to the model's jinja template as they are, and the template decides where they go:

# %%
TWO = toolbench.TOOLS[:2]
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]
print(json.dumps(TWO[0], indent=1))
text = tok.apply_chat_template(PARIS, tools=TWO)
print(text)

# %% [markdown]
# The whole contract is in the system turn. Qwen's template writes a default system line, then
# a `# Tools` section: each function as one line of JSON (jinja's `tojson`) between `<tools>`
# and `</tools>`, and an instruction showing the call's shape, a JSON object with `name` and
# `arguments` between `<tool_call>` tags. The layout is the model's own, shipped in its chat
# template, and it is all the model learns of the functions. transformers renders the same
# template to the same text, character for character: `tests/test_tools.py` holds ours to its
# `apply_chat_template` on a whole conversation with tools, calls and results (this notebook
# leaves transformers unloaded, to stay quick).
#
# What that costs in tokens, part by part (each token counted in the part where its text
# starts; `<|im_start|>`, `<tool_call>` and friends are single tokens):

# %%
def parts_of(text):
    """The rendered prompt cut into named parts: (name, start, end) character spans."""
    cuts = [("system line", 0)]
    cuts.append(("'# Tools' and '<tools>'", text.index("\n\n# Tools")))
    for t in re.finditer(r'\n\{"type": "function", "function": \{"name": "(\w+)"', text):
        cuts.append((f"tool {t.group(1)}", t.start()))
    cuts.append(("'</tools>' and the instruction", text.index("\n</tools>")))
    user = text.index("<|im_end|>\n<|im_start|>user") + len("<|im_end|>\n")
    cuts.append(("user turn and 'assistant'", user))
    return [(name, start, end) for (name, start), (_, end) in zip(cuts, cuts[1:] + [("", len(text))])]


def token_counts(text):
    """Tokens of each part, by where each token's text starts (the tokenizer's offsets)."""
    offsets = [s for s, _ in tok.backend.encode(text, add_special_tokens=False).offsets]
    return {name: sum(start <= o < end for o in offsets) for name, start, end in parts_of(text)}


PLAIN = tok.encode_chat(PARIS)
counts = {n: token_counts(tok.apply_chat_template(PARIS, tools=toolbench.TOOLS[:n])) for n in (1, 2, 3)}
print(f"without tools: {len(PLAIN)} tokens")
for n, c in counts.items():
    print(f"with {n} tool{'s' if n > 1 else ' '}: {sum(c.values())} tokens = "
          + ", ".join(f"{k} {v}" for k, v in c.items()))  # fmt: skip
    assert sum(c.values()) == len(tok.encode_chat(PARIS, tools=toolbench.TOOLS[:n]))
OPEN_ID = tok.encode("<tool_call>", add_bos=False)
print(f"'<tool_call>' encodes to {OPEN_ID}; '</tool_call>' to {tok.encode('</tool_call>', add_bos=False)}")
assert OPEN_ID == [151657]

# %% [markdown]
# Without tools the prompt is 36 tokens. One function brings it to 191, two to 250, all three
# to 373. The `# Tools` header and the closing instruction cost 35 and 44 tokens whatever the
# functions; each function costs the tokens of its JSON: 78 for `get_weather`, 59 for
# `get_time`, 123 for `convert_currency` with its three arguments and two patterns. Every turn
# of a conversation that offers the functions pays for them again, which is what prefix caching
# is for: the block is the same text in every such request, so its KV blocks are computed once
# and found again. And `<tool_call>` is one added token, 151657 (`</tool_call>` 151658): the
# instruction shows the model the tag as that token, and a model that writes the tag writes it.
#
# **A template without tools.** SmolLM2-135M-Instruct, the course's default model, has a
# template that never mentions `tools`: rendering it with them gives the same prompt as
# without. `Tokenizer.supports_tools` finds that out by rendering a probe function and looking
# for its name in the text, and `check_tools` refuses a request whose tools the model would
# never see:

# %%
SMOL_DIR = fetch_default_model()
smol_tok = Tokenizer.from_dir(SMOL_DIR)
same = smol_tok.apply_chat_template(PARIS, tools=TWO) == smol_tok.apply_chat_template(PARIS)
print(f"Qwen's template supports_tools: {tok.supports_tools}; SmolLM2's: {smol_tok.supports_tools} "
      f"(its prompt with tools equals its prompt without: {same})")  # fmt: skip
assert tok.supports_tools and not smol_tok.supports_tools and same
try:
    check_tools(TWO, "auto", smol_tok.supports_tools)
except InvalidParam as e:
    print(f"check_tools: InvalidParam on {e.param!r}: {e}")

smol_config = EngineConfig(max_batch=1, kv_budget="16MiB", max_model_len=256, linear="plain")  # no packing
smol = Engine(load_model(SMOL_DIR), smol_tok, smol_config)
with served(smol) as url:
    body = {"messages": PARIS, "tools": TWO, "max_tokens": 8}
    refused = HTTP.post(url + "/v1/chat/completions", json=body)
    quiet = HTTP.post(url + "/v1/chat/completions", json=body | {"tool_choice": "none", "temperature": 0})
print(f"the server, tools offered to SmolLM2: {refused.status_code} {json.dumps(refused.json(), indent=1)}")
print(f"the same with tool_choice 'none': {quiet.status_code}, "
      f"{quiet.json()['choices'][0]['message']['content']!r}")  # fmt: skip
assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools" and quiet.status_code == 200
del smol

# %% [markdown]
# SmolLM2's template drops `tools` on the floor, so serving them would answer a request whose
# model never saw a function. The server refuses it instead, with a 400 that names `tools` and
# says what to do; the same request with tool_choice "none" is served, since "none" keeps the
# tools out of the prompt anyway (what SmolLM2 makes of the weather in 8 greedy tokens is its
# own business).
#
# ## 2. Reading a call back out of an answer
#
# The other half of the contract is a parser. Written by hand it is a regular expression for
# the blocks and `json.loads` for what is inside; a block that does not hold a JSON object with
# a string `name` (and `arguments`, when present, an object) is not a call and stays in the text,
# where the client can see what the model wrote. OpenAI sends each call's arguments as a JSON
# string, so the object is serialized again.

# %%
BLOCK_BY_HAND = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_by_hand(text):
    """(content, calls): every well-formed block becomes a call, everything else is content."""
    content, calls, at = [], [], 0
    for m in BLOCK_BY_HAND.finditer(text):
        try:
            data = json.loads(m.group(1))
        except ValueError:
            continue
        if not (isinstance(data, dict) and isinstance(data.get("name"), str) and data["name"]):
            continue
        if not isinstance(data.get("arguments", {}), dict):
            continue
        content.append(text[at : m.start()])
        at = m.end()
        arguments = json.dumps(data.get("arguments", {}), ensure_ascii=False)
        calls.append({"type": "function", "function": {"name": data["name"], "arguments": arguments}})
    content.append(text[at:])
    return "".join(content).strip() or None, calls


def block(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


CALL_PARIS, CALL_TOKYO = block("get_weather", {"city": "Paris"}), block("get_time", {"city": "Tokyo"})
TEXTS = {
    "one call": CALL_PARIS,
    "text, then a call": "Let me check.\n" + CALL_PARIS,
    "two calls": CALL_PARIS + "\n" + CALL_TOKYO + "\n",
    "malformed JSON, then a call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n'
    + "</tool_call>\n"
    + CALL_TOKYO,
    "no name": '<tool_call>\n{"arguments": {}}\n</tool_call>',
    "unclosed": 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}',
    "a ```json fence": '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
}
def without_ids(calls):
    """Calls without what differs between two parses of one text: the ids (and a stream's index)."""
    return [{k: v for k, v in c.items() if k not in ("id", "index")} for c in calls]



for name, text in TEXTS.items():
    mine, theirs = parse_by_hand(text), parse_tool_calls(text)
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in mine[1]]
    print(f"{name:<28} calls {calls}, content {mine[0]!r}")
    assert mine == (theirs[0], without_ids(theirs[1])), name
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in theirs[1])
print(f"parse_tool_calls agrees on all {len(TEXTS)} (its calls carry an id besides: call_ and 24 hex digits)")

# %% [markdown]
# The hand parser and `parse_tool_calls` agree on all seven texts, the ones that are not calls
# included. A block whose JSON does not parse stays in the content as the model wrote it, while
# the good block after it becomes a call; a block without a name is text, and so is an unclosed
# one; and so is a call written in a ```json fence, which is what the model of section 3 writes
# when it is left alone. The package adds what the hand version leaves out: an id for each call,
# which the client sends back with the function's result.
#
# **Streamed.** A streamed answer arrives a few characters at a time, and the server must decide
# for each piece whether it is text for the client or part of a call. `ToolCallStream` sends
# text as soon as it cannot be the start of a block, holds a suffix that could still become
# `<tool_call>`, holds a whole block until it closes, and then sends the call in one delta.
# Here the two-call text with some prose around it, fed in pieces of 9 characters:

# %%
STREAMED = "Checking both.\n" + CALL_PARIS + "\n" + CALL_TOKYO + "\nDone."


def stream(text, cut, stream_class=ToolCallStream):
    """Feed `text` in pieces of `cut` characters: ([(piece, deltas)], finish's deltas)."""
    s = stream_class()
    fed = [(text[i : i + cut], s.feed(text[i : i + cut])) for i in range(0, len(text), cut)]
    return fed, s.finish()


def two_pieces(text, at):
    s = ToolCallStream()
    fed = [(text[:at], s.feed(text[:at])), (text[at:], s.feed(text[at:]))]
    return fed, s.finish()


def reassembled(fed, tail):
    deltas = [d for _, ds in fed for d in ds] + tail
    content = "".join(d.get("content", "") for d in deltas) or None
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    return content, calls


fed, tail = stream(STREAMED, 9)
for piece, deltas in fed:
    brief = [{k: (v if k == "content" else [c["function"]["name"] for c in v]) for k, v in d.items()}
             for d in deltas]  # fmt: skip
    print(f"{piece!r:<16} -> {brief}")
print(f"finish -> {tail}")
content, calls = reassembled(fed, tail)
whole = parse_tool_calls(STREAMED)
assert (content, without_ids(calls)) == (whole[0], without_ids(whole[1]))
assert [c["index"] for c in calls] == [0, 1]
for cut in range(1, len(STREAMED) + 1):  # every piece size, and every place to cut the text in two
    for got in (reassembled(*stream(STREAMED, cut)), reassembled(*two_pieces(STREAMED, cut))):
        assert (got[0], without_ids(got[1])) == (whole[0], without_ids(whole[1])), cut
print(f"reassembled equals parse_tool_calls: content {content!r}, {len(calls)} calls; so for every piece "
      f"size from 1 to {len(STREAMED)} and every cut into two pieces")  # fmt: skip

# %% [markdown]
# Text goes out at once ("Checking", " both."); the newline after it waits with the `<to` that
# may be a tag. Nothing goes out while a block is open, and each call goes out whole in the
# piece where its `</tool_call>` completes, with its `index`, 0 and then 1. The text between
# and after the blocks, three newlines and "Done.", goes out last, since whitespace is held
# until text follows it. Joined, the deltas are the whole answer's content and calls, for
# every piece size from 1 to all 179 characters and every cut into two pieces. OpenAI and vLLM
# stream a call's arguments in fragments; this stream sends a call when its block closes, which
# costs a client nothing (it joins the fragments before it can use them) and spares the server
# a parser of unfinished JSON.
#
# ## 3. The real model
#
# Now Qwen2.5-Coder-0.5B-Instruct behind `create_app`, reached over HTTP as a client would,
# with the day's three functions (`get_weather`, `get_time`, `convert_currency`; the last takes
# an amount and two ISO 4217 codes held to `^[A-Z]{3}$`), greedy, at most 60 new tokens.

# %%
TOOLS = toolbench.TOOLS
server = served(engine)
url = server.__enter__()  # uvicorn on a free port of 127.0.0.1, in a thread; closed in section 4


def chat(messages, stream=False, **fields):
    body = {"messages": messages, "temperature": 0, "max_tokens": toolbench.MAX_TOKENS, **fields}
    if not stream:
        t0 = time.perf_counter()
        r = HTTP.post(url + "/v1/chat/completions", json=body)
        return r, time.perf_counter() - t0
    with HTTP.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]


auto, took = chat(PARIS, tools=TOOLS, tool_choice="auto")
a = auto.json()
print(f"tool_choice 'auto' ({a['usage']['prompt_tokens']} prompt tokens, {a['usage']['completion_tokens']} "
      f"generated, in {took:.1f} s):")  # fmt: skip
print(shown(a["choices"][0]))
assert auto.status_code == 200 and "tool_calls" not in a["choices"][0]["message"]

# %% [markdown]
# Left free, the model knows what the question needs: `get_weather`, with the city and a unit.
# It wrote that as a JSON object in a ```json fence, not between the tags, so the server
# returns it as text with `finish_reason` "stop": to an OpenAI client this is an answer, and
# nothing gets called. Section 5 finds the same for every one of its 12 prompts that call for a
# function. The 0.5B model copies the instruction's JSON and drops the tags around it.
#
# **"required".** The server turns tool_choice "required" into a grammar (`tool_grammar`) in
# llguidance's Lark dialect, and from then on it is day 66's machinery: compiled once, a token
# mask each step, every other logit set to -inf before the sampler. The grammar for the three
# functions:

# %%
GRAMMAR = tool_grammar(TOOLS, "required")
print(GRAMMAR)
required, took = chat(PARIS, tools=TOOLS, tool_choice="required", return_token_ids=True)
r = required.json()
answer_ids = r["choices"][0].pop("token_ids")  # the forced call's tokens (return_token_ids)
print(f"tool_choice 'required' ({r['usage']['completion_tokens']} generated, in {took:.1f} s):")
print(shown(r["choices"][0]))
print(f"token ids: {answer_ids}")
call = r["choices"][0]["message"]["tool_calls"][0]
arguments = json.loads(call["function"]["arguments"])
jsonschema.validate(arguments, toolbench.SCHEMAS[call["function"]["name"]])
print(f"{call['function']['name']}'s arguments {arguments} validate against its schema")
assert r["choices"][0]["finish_reason"] == "tool_calls" and r["choices"][0]["message"]["content"] is None

# %% [markdown]
# Under the grammar the same prompt gives the call the template describes, 29 tokens from
# `<tool_call>` (151657) to `</tool_call>` (151658), a newline and `<|im_end|>` (151645). The
# server returns it as `tool_calls`, with `content` null and `finish_reason` "tool_calls", and
# its arguments validate against the function's schema. They are the function and arguments
# the model chose in prose; the grammar changed the wrapping, not the choice.
#
# What the mask allowed at each of the 29 steps (`Grammars.fill`, the bits counted):

# %%
m = engine.grammars.matcher(Guided("grammar", GRAMMAR, "tool_choice"))
allowed = []
for t in answer_ids:  # the last is <|im_end|>, the end of the assistant's turn
    allowed.append(sum(bin(w & 0xFFFFFFFF).count("1") for w in engine.grammars.fill([m])[0].tolist()))
    assert m.consume_token(t)
pieces = [tok.decode([t], skip_special_tokens=False) for t in answer_ids]
for row in range(0, len(pieces), 6):
    print("   ".join(f"{p!r} {a:,}" for p, a in zip(pieces[row : row + 6], allowed[row : row + 6])))
print(f"{sum(a == 1 for a in allowed)} of {len(allowed)} steps allow one token")
assert allowed[0] == 1 and pieces[0] == "<tool_call>"

# %% [markdown]
# 15 of the 29 steps allow one token: the tags, the newlines and the frame of the JSON,
# `{"name": "` and `", "arguments": {"`, are the grammar's text, and the model only confirms
# them. The model chooses the function among 8 tokens that begin one of the three names (`get`,
# `c`, `conv`, ...), then 8 that go on from `get` (`_weather`, `_time`, `_w`, ...). The first
# argument's name is forced (`city`, the required property, comes first in the JSON this grammar
# writes); its value may be any of 147,029 tokens that can stand inside a JSON string. The
# step where the model wrote `unit` allowed 146,991 tokens, not one: `get_weather`'s schema
# does not say `additionalProperties` is false, so any key may follow, and only the model made
# it `unit`. At the end `"}}` was one of 5 ways to close, and after the last newline the grammar
# allows `<|im_end|>` or another `<tool_call>`.
#
# **One function by name**, streamed. The question "Is it morning or evening in New York right
# now?" calls for `get_time`; under "required" the model picks `get_weather` for it (section
# 5's table). Naming the function leaves it no choice, `{"type": "function", "function":
# {"name": "get_time"}}`, whose grammar is one call of that function:

# %%
NEW_YORK = [{"role": "user", "content": "Is it morning or evening in New York right now?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
print(tool_grammar(TOOLS, NAMED))
chunks = chat(NEW_YORK, stream=True, tools=TOOLS, tool_choice=NAMED, stream_options={"include_usage": True})
deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
print(f"{chunks[-1]['usage']['completion_tokens']} tokens generated")
finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
finish = [reason for reason in finish if reason]
print(f"{len(deltas)} chunks with a delta: the role first, {sum(d == {} for d in deltas)} empty, "
      f"{sum('tool_calls' in d for d in deltas)} with the call; then the usage:")  # fmt: skip
for d in deltas:
    if d:
        print("  ", shown(d, indent=None))
print(f"finish_reason: {finish}")
streamed_call = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
assert streamed_call["function"]["name"] == "get_time" and finish == ["tool_calls"]
assert not any("content" in d and d["content"] for d in deltas)  # nothing of the block leaked as text

# %% [markdown]
# The named grammar is one call of `get_time`, so the function is no longer the model's to
# pick; the arguments still are: `{"city": "New York", "unit": "celsius"}`. `unit` is not an
# argument of `get_time`, and yet the call validates: `get_time`'s schema names `city` and
# forbids nothing else (Try it 3 closes that). Streamed, the answer is the role chunk, one
# chunk with the whole call, and `finish_reason` "tool_calls": the tokens that `ToolCallStream`
# holds back while the block is open send no chunk at all; nothing of the block leaks as content.
#
# **The round trip.** The client runs `get_weather` and sends the conversation back: the user's
# question, the assistant's turn holding the call (`content` null, `tool_calls` as the server
# returned them) and a `tool` message with the result and the call's id. The template writes
# the call back as the block the model would have written, and the result as a
# `<tool_response>` inside a user turn:

# %%
RESULT = {"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "light rain"}
ROUND_TRIP = PARIS + [
    {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(RESULT)},
]
rendered = tok.apply_chat_template(ROUND_TRIP, tools=TOOLS)
print(rendered[rendered.index("<|im_start|>user") :])
assert rendered.count(r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == 1

# %% [markdown]
# The model's answer to the result is free text, sixty greedy tokens long under int8
# activations, and it is the one output of this notebook that other CPUs' int8 paths change
# (under the AVX-512 build without VNNI its first answer ends with finish_reason "stop", not
# "length"), so nbval does not compare it.

# %%
# NBVAL_IGNORE_OUTPUT
with ThreadPoolExecutor(2) as both:  # the two requests at once: the server decodes them in one batch
    replies = both.map(lambda more: chat(ROUND_TRIP, tools=TOOLS, **more), ({}, {"tool_choice": "none"}))
(final, took), (plain, took_plain) = replies
f = final.json()
print(f"\nthe model's answer ({f['usage']['prompt_tokens']} prompt tokens, in {took:.1f} s): "
      f"finish_reason {f['choices'][0]['finish_reason']!r}")  # fmt: skip
print(f["choices"][0]["message"]["content"])
p = plain.json()
print(f"\nwith tool_choice 'none' ({p['usage']['prompt_tokens']} prompt tokens: the tools are left out, "
      f"in {took_plain:.1f} s): finish_reason {p['choices'][0]['finish_reason']!r}")  # fmt: skip
print(p["choices"][0]["message"]["content"])

# %% [markdown]
# The template writes the call back as the model would have written it, its arguments string
# parsed back into an object (`check_messages` does that: OpenAI sends a JSON string, Qwen's
# template writes `arguments | tojson`), and the result as a `<tool_response>` in a user turn,
# the same text transformers renders (`tests/test_tools.py` checks a round trip like this one).
#
# The model's part of the round trip goes less well. On the CPU this notebook was run on, given
# the result it writes calls again, in prose: `get_weather` as before, then `get_time` and
# `convert_currency` with arguments of its own, until the 60 tokens run out (`finish_reason`
# "length"). With tool_choice "none" the server leaves the tools out of the prompt (107 prompt
# tokens instead of 444), and the model still answers with a call: `get_weather` again, with the
# result's `"condition": "light rain"` folded into its arguments. It read the result, and put it
# where it has learned to put things. That is the model: Qwen2.5-Coder-0.5B knows the shape of a
# call and not what to do with a function's answer. The server's part, rendering the turn and
# the result as the template wants them, is what the comparison with transformers in
# `tests/test_tools.py` checks.
#
# ## 4. Two mistakes, planted
#
# **The tags spelled as text.** In `tool_grammar` the tags are token references, `<tool_call>`
# unquoted in Lark. Quoting them, `"<tool_call>"`, reads as the same thing and is a different
# grammar: a string of bytes where the model's own format has one added token. Planted in the
# server for one request:

# %%
def quoted_tags(tools, tool_choice):
    grammar = tool_grammar(tools, tool_choice)
    for tag in ("<tool_call>", "</tool_call>"):
        grammar = grammar and grammar.replace(f" {tag}", f' "{tag}"')
    return grammar


print(quoted_tags(TOOLS, "required").splitlines()[2])
quoted = Guided("grammar", quoted_tags(TOOLS, "required"), "tool_choice")
first = engine.grammars.fill([engine.grammars.matcher(quoted)])[0]
offered = [t for t in range(engine.grammars.vocab_size) if (int(first[t // 32]) >> (t % 32)) & 1]
print(f"its first mask allows {offered}")
with mock.patch("nanoserve.serve.tool_grammar", quoted_tags):
    broken, _ = chat(PARIS, tools=TOOLS, tool_choice="required")
print(f"the server: {broken.status_code} {broken.json()['error']['type']}: "
      f"{broken.json()['error']['message'].splitlines()[0]}")  # fmt: skip
server.__exit__(None, None, None)


def takes(grammar, ids):
    """Whether a matcher of `grammar` accepts `ids` one by one: (accepted, the first refused index)."""
    m = engine.grammars.matcher(Guided("grammar", grammar, "tool_choice"))
    for i, t in enumerate(ids):
        if not m.consume_token(t):
            return False, i
    return True, None


print(f"the right grammar takes the {len(answer_ids)} ids of the answer: {takes(GRAMMAR, answer_ids)}")
print(f"the quoted one: {takes(quoted_tags(TOOLS, 'required'), answer_ids)}")
assert takes(GRAMMAR, answer_ids) == (True, None)
assert broken.status_code == 500 and takes(quoted_tags(TOOLS, "required"), answer_ids) == (False, 0)

# %% [markdown]
# The quoted grammar compiles, and fails at the first token. Its first mask allows one token,
# 151657, because that is how our tokenizer spells the text `<tool_call>`; when the row feeds
# that token back, the same matcher refuses it, since to llguidance an added token is special
# and matches no quoted string. The engine ends the row with that refusal as its error
# (`Grammars.advance`: a mask and a matcher that disagree are a bug, said on the row rather
# than hidden) and the server answers 500. Asked directly, the right grammar takes all 29 ids
# of section 3's call and the quoted one refuses the first. `tests/test_tools.py` holds both:
# the grammars must force 151657 first, and must take our tokenizer's ids of a good call.
#
# **A stream that does not hold back.** `ToolCallStream` keeps the longest suffix of the text
# that could still become `<tool_call>` (`_partial_open`). Planted: it keeps nothing.

# %%
with mock.patch("nanoserve.tools._partial_open", lambda text: 0):
    fed, tail = stream(STREAMED, 9)
leaked = reassembled(fed, tail)
print(f"content streamed: {leaked[0]!r}")
print(f"calls: {[c['function']['name'] for c in leaked[1]]}")
try:
    assert leaked[0] == parse_tool_calls(STREAMED)[0], "the streamed content differs from the parsed answer's"
except AssertionError as e:
    print(f"caught: {e}")
else:
    raise RuntimeError("the planted mistake went unnoticed")

# %% [markdown]
# Without the hold-back, the piece `'both.\n<to'` goes out as text whole, the rest of the tag
# arrives with the next piece, and the buffer never holds a whole `<tool_call>`: both calls are
# lost, their blocks reach the client as text, and the content no longer equals the parsed
# answer's. With Qwen the tag is one token and usually arrives whole, which is why this kind of
# mistake survives a demo: a model that spells the tag in ordinary tokens (vLLM's Hermes parser
# buffers `<`, `tool`, `_call`, `>` for that), or text cut anywhere else, exposes it.
# `tests/test_tools.py` feeds answers cut every way and holds the stream to `parse_tool_calls`.
#
# ## 5. "auto" against "required", on 15 prompts
#
# `toolbench.py` runs 15 prompts: 12 that call for one of the three functions (four each) and 3
# that call for none (a haiku, 17 times 3, a sentence about list comprehensions), each rendered
# with all three functions, every prompt of a mode in one batch, greedy, at most 60 tokens.
# Under "auto" nothing constrains the model; under "required" the grammar above does. An answer
# is read as the server reads it, and a call is valid when its arguments validate against the
# function's schema. It also notes the calls the model wrote as JSON outside a block (in a
# ```json fence or bare), which the server does not return as calls. The notebook runs 3 of the
# prompts (`toolbench.SMALL`); the script ran all 15:

# %%
SMALL = [toolbench.PROMPTS[i] for i in toolbench.SMALL]
answers, summary, by_mode = toolbench.bench(engine, SMALL)
ANSWERS = read_csv(toolbench.HERE / "day-67-answers.csv")
SUMMARY = read_csv(toolbench.HERE / "day-67-summary.csv")
print(f"{'prompt':<50} {'wants':<17} {'auto':<31} {'required'}")
for r in answers:
    auto_cell = f"{r['auto_answer']}: {r['auto_called']}"
    req_cell = f"{r['required_called']} (valid {r['required_valid']})"
    print(f"{r['prompt']:<50} {r['wanted']:<17} {auto_cell:<31} {req_cell}")
committed = {row["prompt"]: row for row in ANSWERS}
assert as_text(answers) == [committed[r["prompt"]] for r in answers]  # the script's rows for these prompts
print()
for label, rows in (("here, 3 prompts", summary), ("the script, 15", SUMMARY)):
    for s in rows:
        print(f"{label:<16} {s['mode']:<9} valid calls {s['valid_calls']} of {s['prompts_calling']} "
              f"(right function {s['right_function']}), calls in prose {s['calls_in_prose']} (right "
              f"function {s['prose_right_function']}), other prompts "
              f"answered in text {s['other_in_text']} of {s['prompts_other']}, {s['tokens']} tokens in "
              f"{float(s['seconds']):.1f} s")  # fmt: skip
auto_row, required_row = SUMMARY
assert auto_row["valid_calls"] == "0" and required_row["valid_calls"] == required_row["prompts_calling"]

# %% [markdown]
# The notebook's three rows equal the script's rows for the same prompts (the `assert`): the
# greedy answers did not depend on which prompts shared the batch. Over all 15, left free, the
# model wrote no call the server could return, 0 of 12, while it wrote a call as JSON for all
# 12 prompts that want one and named the right function in 10 of them; it wrote one for "What
# is 17 times 3?" too, a `get_weather` call. Forced, all 12 are valid calls, 11 with the right
# function (it keeps `get_weather` for morning or evening in New York), and the three prompts
# that want no function get a call as well, because "required" means a call. The grammar
# turned 0 returned calls into 12 at about the same number of tokens, 464 against 446.
#
# ## 6. The diagram

# %%
fig = plt.figure(figsize=(16, 10.5))
grid = fig.add_gridspec(2, 2, hspace=0.4, wspace=0.35)

ax = fig.add_subplot(grid[0, 0])
colors = ["#999999", "#e69138", "#f6b26b", "#f9cb9c", "#fce5cd", "#6fa8dc", "#b7b7b7"]
labels = [f"{n} tool{'s' if n > 1 else ''}" for n in counts] + ["no tools"]
for y, n in enumerate(counts):
    left = 0
    for name, v in counts[n].items():
        color = {"system line": colors[0], "'# Tools' and '<tools>'": colors[1],
                 "'</tools>' and the instruction": colors[5], "user turn and 'assistant'": colors[-1]}.get(
            name, colors[2])  # fmt: skip
        ax.barh(y, v, left=left, color=color, edgecolor="white")
        if v >= 12:
            ax.text(left + v / 2, y, str(v), ha="center", va="center", fontsize=8)
        left += v
    ax.text(left + 4, y, f"{left}", va="center", fontsize=9)
ax.barh(len(counts), len(PLAIN), color=colors[-1], edgecolor="white")
ax.text(len(PLAIN) + 4, len(counts), f"{len(PLAIN)}", va="center", fontsize=9)
ax.set_yticks(range(len(labels)), labels)
handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i]) for i in (0, 1, 2, 5, -1)]
ax.legend(handles, ["system line", "'# Tools', '<tools>'", "one tool's JSON", "'</tools>', instruction",
                    "user turn, 'assistant'"], fontsize=8, loc="lower right")  # fmt: skip
ax.set_xlabel("prompt tokens for 'What's the weather in Paris?'")
ax.set_title("what the template adds: tokens by part of the prompt", fontsize=11)

ax = fig.add_subplot(grid[0, 1])
metrics = [("valid_calls", "valid call\nreturned"), ("right_function", "... with the\nright function"),
           ("calls_in_prose", "call written as\nJSON in prose"),
           ("prose_right_function", "... with the\nright function")]  # fmt: skip
for k, row in enumerate(SUMMARY):
    xs = [i + (k - 0.5) * 0.38 for i in range(len(metrics))]
    values = [int(row[m_]) for m_, _ in metrics]
    ax.bar(xs, values, 0.38, label=f"tool_choice {row['mode']!r}", color=["#999999", "#e69138"][k])
    for x, v in zip(xs, values):
        ax.text(x, v + 0.2, str(v), ha="center", fontsize=9)
ax.set_xticks(range(len(metrics)), [lbl for _, lbl in metrics])
ax.set_ylim(0, int(SUMMARY[0]["prompts_calling"]) + 3)
ax.set_ylabel(f"answers, of {SUMMARY[0]['prompts_calling']} prompts that call for a tool")
ax.legend(fontsize=9, loc="upper center", ncol=2)
ax.set_title("Qwen2.5-Coder-0.5B, greedy: free against forced (day-67-summary.csv)", fontsize=11)

ax = fig.add_subplot(grid[1, :])
ax.bar(range(len(allowed)), allowed, color=["#999999" if a == 1 else "#e69138" for a in allowed])
for x, a in enumerate(allowed):
    if a > 1:
        ax.text(x, a * 1.3, f"{a:,}" if a < 1000 else f"{a / 1000:.0f}k", ha="center", fontsize=8)
ax.set_yscale("log")
ax.set_ylim(0.5, 1e6)
ax.set_xticks(range(len(pieces)), [repr(p)[1:-1] for p in pieces], rotation=60, fontsize=8, ha="right")
ax.set_ylabel("tokens the mask allows (log)")
ax.set_title("the 'required' grammar along the call it forced: one allowed token (grey) where the format is "
             "fixed, many (orange) where the model chooses", fontsize=11)  # fmt: skip

fig.suptitle("Day 67: tool calls through a chat template (Qwen2.5-Coder-0.5B-Instruct)", fontsize=15)
png = diagram_path("day67-tool-calls.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")

# %% [markdown]
# Top left, the prompt of section 1 by part, without tools and with one, two and three
# functions; top right, the script's 15 prompts under "auto" and "required"; below, the mask of
# the forced call of section 3, step by step.
#
# ## In the real systems
#
# * **vLLM** serves "auto" with `--enable-auto-tool-choice` and a parser named by
#   `--tool-call-parser`; its documentation sends Qwen2.5 to `hermes`, which is
#   `Hermes2ProToolParser` (`vllm/tool_parsers/hermes_tool_parser.py`, earlier under
#   `vllm/entrypoints/openai/tool_parsers/`), a `ToolParser` with `extract_tool_calls` for a
#   whole answer and `extract_tool_calls_streaming` for a stream, registered by name with
#   `ToolParserManager` (`--tool-parser-plugin` loads your own). It reads the same blocks as
#   `parse_tool_calls`, with other choices: its pattern, `<tool_call>(.*?)</tool_call>|<tool_call>(.*)`,
#   also takes an unclosed last block as a call; one block that fails to parse returns the whole
#   answer as content with no calls; the content is the text before the first block. It streams
#   a call's name first and its arguments in fragments (with `partial_json_parser`), and sends
#   no chunk for a token its parser holds, as nanoserve does. "required" and a
#   named function go through its structured outputs, not through the model's own format: for a
#   named function the schema is the function's `parameters` (the model writes the bare
#   arguments), for "required" a JSON array of `{"name", "parameters"}` objects, at least one
#   (`get_json_schema_from_tools` in `vllm/tool_parsers/utils.py`). nanoserve's grammar keeps
#   Qwen's `<tool_call>` blocks, so a forced call reads to the model like the calls it was
#   trained on. Under "auto", a tool marked `strict: true` has its arguments constrained too;
#   and vLLM renders the tools under tool_choice "none" unless started with
#   `--exclude-tools-when-tool-choice-none`, where nanoserve leaves them out.
# * **llama.cpp** (`llama-server --jinja`, which renders the model's own template) picks a
#   chat format in `common/chat.cpp` by looking at the template's source: one that contains
#   `<tool_call>` gets the Hermes 2 Pro handler (`common_chat_params_init_hermes_2_pro`, and
#   `common_chat_parse_hermes_2_pro` for the answer). Its grammar is lazy unless tool_choice is
#   "required": sampling is free until a trigger matches at the start of the answer, and from
#   there the grammar holds the call to the schemas. The triggers are `<tool_call>`,
#   `<function`, and, telling for this notebook, a ```json fence or a bare `{"name": "` followed
#   by one of the tools' names: llama.cpp accepts the call the 0.5B model writes in prose, and
#   its parser takes a list of such near-misses (`<function_call>`, `<tools>`, `<response>`,
#   `<json>`, fences). The tags are among the handler's `preserved_tokens`. (Read in the
#   version of `chat.cpp` we had; newer versions add a PEG-based parser for the same formats.)
# * **transformers** passes `tools` to the template in `apply_chat_template(messages,
#   tools=...)`, as we do (section 1's reference), and also takes Python functions there,
#   turning each signature and docstring into the JSON schema (`get_json_schema`).
# * **OpenAI's API** is the shape all three copy: `tools` of `{"type": "function", "function":
#   {"name", "description", "parameters", "strict"}}`, `tool_choice`, `parallel_tool_calls`;
#   an answer's `tool_calls` with `arguments` as a JSON string and `finish_reason`
#   "tool_calls"; results as `{"role": "tool", "tool_call_id", "content"}`. With `strict: true`
#   OpenAI holds the arguments to the schema (structured outputs, which wants
#   `additionalProperties: false` and every property required). nanoserve holds a forced call's
#   arguments to the schema whatever `strict` says, and constrains nothing under "auto".
#
# nanoserve is strict where llama.cpp is lenient: a call is a well-formed `<tool_call>` block
# or it is text. For this model that means "auto" returns no calls at all; by llama.cpp's rules,
# most of section 5's prose calls would have been read as calls, and the one for 17 times 3 too.
#
# ## Try it
#
# 1. **Be lenient, as llama.cpp is.** Write `lenient(text)`: `parse_tool_calls(text)`, and
#    when it finds no call, `toolbench.prose_call(text)` turned into one call. Run it over the
#    15 answers of `outs, _ = toolbench.run_mode(engine, "auto")` (after `toolbench.warm(engine)`)
#    and validate each call with `toolbench.valid`. The check: 13 calls, every one valid; 10 of
#    the 12 prompts that want a function get the right one (`get_weather` for the New York time
#    and for 250 Canadian dollars); and "What is 17 times 3?" gets a `get_weather` call, as
#    `day-67-answers.csv`'s `auto_called` column says. Decide whether you would ship it.
# 2. **Break the newline.** In `nanoserve/tools.py`'s `tool_grammar`, drop the optional
#    `"\n"?` at the end of the "required" start rule (`'start: call ("\n" call)*'`); the comment
#    above it says what the model does then. Predict, then run `python days/day67/toolbench.py
#    --out /tmp/d67`. The check: every `required_finish` is "length" and every
#    `required_tokens` is 60 (the summary's required `tokens` 15 x 60 against 464), with two calls
#    in most answers; the summary's `valid_calls` still says 12, since the first call of each
#    answer validates. Only the token count and the finish reason show the mistake. Put the
#    `"\n"?` back.
# 3. **Close a schema.** In `toolbench.TOOLS`, give `get_time`'s parameters
#    `"additionalProperties": False` and rerun section 3's named call. The check: the streamed
#    arguments are `{"city": "New York"}` alone, 22 tokens generated instead of 29, and
#    `jsonschema.validate` of the old arguments against the new schema raises a
#    `ValidationError` naming `unit`. Then look at the mask walk above for `get_weather`: the
#    step that allowed 146,991 tokens is the one a closed schema would narrow.
