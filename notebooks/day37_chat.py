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
# # Day 37 — Chat completions
#
# An instruction-tuned model was trained on conversations laid out in one exact way. For
# SmolLM2 that layout is ChatML: each turn opens with `<|im_start|>`, the role's name and a
# newline, then the text, then `<|im_end|>` and a newline. A chat client never sees any of
# that. It sends a list of messages, each with a `role` and `content`, to
# `/v1/chat/completions`, and the server has to turn the list into the one flat token sequence
# the model was trained on. The model directory says how, in its chat template (a small Jinja
# program), and Day 1's `Tokenizer.apply_chat_template` runs it.
#
# Everything the model does depends on that rendering being exactly right, down to the last
# token. The template's last step, the *generation prompt* `<|im_start|>assistant\n`, is what
# tells the model that the next turn is its own. Today checks the rendering by hand, then checks
# that the server feeds the model exactly those token ids, and then leaves the generation prompt
# out on purpose to see what the model does instead.
#
# 1. the template: SmolLM2's source, the same text rendered in a few lines of our own, and its
#    token ids,
# 2. what the server tokenizes: its usage counts and its first-token scores against a
#    completions request given our ids, for five conversations, and the roles it takes,
# 3. a chat request through the `openai` client, equal token for token to the completions
#    route,
# 4. the template without the generation prompt: a check that catches it, and what the model
#    writes instead,
# 5. the day's table of answers (`days/day37/chat.py`),
# 6. the diagram.

# %%
import sys

import matplotlib
import openai
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve.bench import cpu_line
from nanoserve.models import load_model
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day37"))
import chat  # the day's script: the notebook runs its requests and reads its tables

torch.set_num_threads(1)  # the machine is shared; one thread keeps the timings comparable
print(cpu_line())
MODEL_DIR = fetch_default_model()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
engine = chat.make_engine(model, tok)  # engine_config(37, ...): the engine of day 34
server = chat.served(engine)
url = server.__enter__()  # uvicorn on a free port of 127.0.0.1, in a thread; closed at the end
print("serving", chat.HTTP.get(url + "/v1/models").json()["data"][0]["id"], "on http://127.0.0.1:PORT")


def committed(name):
    """A CSV of days/day37/ as the journal's tables read it."""
    return read_csv(REPO / "days" / "day37" / f"day-37-{name}.csv")


# %% [markdown]
# ## 1. The template
#
# SmolLM2's `chat_template.jinja`, whole:

# %%
print(tok.template_source)

# %% [markdown]
# It does three things: if the conversation does not start with a system message it puts
# SmolLM2's own in front; it writes every message as `<|im_start|>role\ncontent<|im_end|>\n`;
# and with `add_generation_prompt` it ends with `<|im_start|>assistant\n`. The same in a few
# lines of Python, checked against the package's renderer on all five of the day's
# conversations (`chat.CONVERSATIONS`, as `chat.as_engine_sees` hands them to the template:
# content parts joined, `developer` turned into `system`):

# %%
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def render(messages, add_generation_prompt=True):
    text = ""
    if messages[0]["role"] != "system":
        text += f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
    for m in messages:
        text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


for name, messages in chat.CONVERSATIONS.items():
    seen = chat.as_engine_sees(messages)
    for gen in (True, False):
        assert render(seen, gen) == tok.apply_chat_template(seen, add_generation_prompt=gen), name
print("render() equals apply_chat_template on", len(chat.CONVERSATIONS), "conversations, with and without",
      "the generation prompt")  # fmt: skip
two = chat.CONVERSATIONS["system + user"]
print(repr(render(two)))

# %% [markdown]
# The ids. `<|im_start|>` and `<|im_end|>` are single special tokens (1 and 2), not spelled
# out letter by letter, and `<|im_end|>` is also the end-of-sequence id, so a reply ends where
# the model closes its turn. The generation prompt is the last 4 tokens ("assistant" is two).
# The template writes its own `<|im_start|>`, which is also this tokenizer's BOS token, so the
# rendered text is encoded with no BOS added (`Tokenizer.encode_chat` does the same); adding
# one would start the prompt with the token twice.

# %%
ids = chat.template_ids(tok, two)
for start in range(0, len(ids), 13):
    print("  ".join(f"{t}:{tok.token_text(t)!r}" for t in ids[start : start + 13]))
bare = chat.template_ids(tok, two, add_generation_prompt=False)
print("the generation prompt:", [tok.token_text(t) for t in ids[len(bare) :]])
print("special:", tok.bos_id, "=", tok.token_text(tok.bos_id), "| eos:", sorted(tok.eos_ids))
default_block = tok.encode(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n", add_bos=False)
print("SmolLM2's default system message, when the template adds it:", len(default_block), "tokens")
assert ids == tok.encode_chat(chat.as_engine_sees(two))
assert ids[: len(bare)] == bare and len(ids) - len(bare) == 4
assert tok.encode(render(two), add_bos=True)[:2] == [1, 1]  # the doubled start a BOS would make

# %% [markdown]
# ## 2. What the server tokenizes
#
# The server renders and tokenizes on its side, so the client cannot see its ids directly. Two
# things can be compared. Its `usage.prompt_tokens` must be the length of our ids. And the
# scores of the first answer token must be the same from `/v1/chat/completions` (the server's
# rendering) and from `/v1/completions` given our ids as the prompt: the top 5 tokens and their
# log-probabilities are a function of every token the model saw, so two prompts that differ
# anywhere would not give the same five numbers. `chat.prompt_row` does both for each
# conversation, one token per request, and also asks which token the model writes first after
# the rendering without the generation prompt (`bare_first_id`, section 4; id 1 is
# `<|im_start|>`).

# %%
rows = [chat.prompt_row(url, tok, name, m) for name, m in chat.CONVERSATIONS.items()]
cols = list(rows[0])
print(" | ".join(cols))
for r in rows:
    print(" | ".join(str(r[k]) for k in cols))
assert [[str(r[k]) for k in cols] for r in rows] == [[r[k] for k in cols] for r in committed("prompts")]
assert all(r["server_prompt_tokens"] == r["template_tokens"] and r["same_top5"] == "yes" for r in rows)
assert all(r["bare_first_id"] == tok.bos_id for r in rows)

# %% [markdown]
# Each conversation's `prompt_tokens` equals our count and each first-token distribution equals
# the completions route's on our ids. Two conversations got SmolLM2's default system message,
# which is why a one-line question costs 42 tokens. `developer` (the name OpenAI's newer models
# give the system role) renders exactly as `system`. A message given as a list of text parts is
# joined into one string first. A role the API does not have is refused before anything is
# rendered:

# %%
r = chat.HTTP.post(url + "/v1/chat/completions", json={"messages": [{"role": "function", "content": "42"}]})
print(r.status_code, r.json()["error"]["param"], "|", r.json()["error"]["message"][:90])
assert r.status_code == 400

# %% [markdown]
# ## 3. A chat request through the `openai` client
#
# The multi-turn conversation: a system message, a question, the assistant's earlier answer
# ("Blue."), and a follow-up. Greedy, so the reply is the same every run. It ends because the
# model wrote `<|im_end|>`, so the finish reason is `stop`, and that last id is counted in the
# usage and returned in `token_ids` but not in the text. The same ids sent to the completions
# route give the same tokens.

# %%
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
turns = chat.CONVERSATIONS["multi-turn"]
reply = client.chat.completions.create(
    model=chat.MODEL_NAME, messages=turns, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
)
choice = reply.choices[0]
token_ids = choice.model_extra["token_ids"]
print(reply.object, "|", choice.message.role, repr(choice.message.content), choice.finish_reason, reply.usage)
print("token ids:", token_ids, [tok.token_text(t) for t in token_ids])
same = chat.complete(url, chat.template_ids(tok, turns), max_tokens=8, return_token_ids=True)
assert same["choices"][0]["token_ids"] == token_ids and token_ids[-1] in tok.eos_ids
assert reply.usage.prompt_tokens == len(chat.template_ids(tok, turns))
assert reply.usage.completion_tokens == len(token_ids)

# %% [markdown]
# ## 4. The template without the generation prompt
#
# A renderer that forgets `add_generation_prompt` (the default of transformers'
# `apply_chat_template` is False, so it is an easy mistake for a client that renders prompts
# itself) produces a prompt 4 tokens shorter. `check_prompt` is the check of section 2 as a
# function: a client-side rendering must have the server's token count and the server's
# first-token scores. The right rendering passes, the bare one fails:


# %%
def check_prompt(messages, ids):
    by_chat = chat.chat(url, messages, max_tokens=1, logprobs=True, top_logprobs=5)
    if by_chat["usage"]["prompt_tokens"] != len(ids):
        theirs = by_chat["usage"]["prompt_tokens"]
        raise AssertionError(f"{len(ids)} tokens rendered, the server's prompt has {theirs}")
    if not chat.same_top5(by_chat, chat.complete(url, ids, max_tokens=1, logprobs=5)):
        raise AssertionError("the same length, but the model saw different tokens")


check_prompt(two, ids)
try:
    check_prompt(two, bare)
except AssertionError as e:
    print("rendered without the generation prompt -> AssertionError:", e)
else:
    raise AssertionError("the bare rendering passed")

# %% [markdown]
# What the model does with the bare prompt: it has just seen a user turn end, and what comes
# after a finished turn in its training data is the next turn's header. So it writes the header
# itself, `<|im_start|>assistant\n`, and then answers. The answer is the same, but the first 4
# of its `max_tokens` go to the header, and since only `<|im_start|>` is a special token, the
# word "assistant" and a newline end up at the front of the text a client shows. The first
# token's top 5, with and without:

# %%
with_gen = chat.complete(url, ids, max_tokens=1, logprobs=5)["choices"][0]["logprobs"]["top_logprobs"][0]
bare_out = chat.complete(url, bare, max_tokens=8, logprobs=5, return_token_ids=True)["choices"][0]
without = bare_out["logprobs"]["top_logprobs"][0]
for label, top in (("with the generation prompt", with_gen), ("without it", without)):
    print(f"{label:>27}:", {t: round(torch.tensor(lp).exp().item(), 3) for t, lp in top.items()})
print("bare prompt's reply:", repr(bare_out["text"]), [tok.token_text(t) for t in bare_out["token_ids"]])
assert bare_out["token_ids"][:4] == ids[len(bare) :]  # the model wrote the missing header itself
assert bare_out["text"].startswith("assistant\n")

# %% [markdown]
# ## 5. The day's table of answers
#
# `chat.answer_row` asks each conversation for a greedy reply of up to 16 tokens on both routes
# and on the bare rendering. The committed run (the journal's table):

# %%
answers = committed("answers")
for a in answers:
    print(f"{a['conversation']:>16}: {a['chat_text']!r} ({a['chat_tokens']} tokens, {a['finish_reason']}), "
          f"completions the same: {a['same_as_completions']}")  # fmt: skip
    unescaped = a["bare_text"].replace("\\n", "\n")  # the CSV writes a newline as \n
    print(f"{'bare':>16}: {unescaped!r} ({a['bare_tokens']} tokens, {a['bare_finish']})")
assert all(a["same_as_completions"] == "yes" for a in answers)
assert all(a["bare_text"].startswith("assistant\\n") for a in answers)
live = chat.answer_row(url, tok, "multi-turn", turns, 16)  # the shortest, again here
keep = ["conversation", "chat_text", "chat_tokens", "finish_reason", "same_as_completions", "bare_text",
        "bare_tokens", "bare_finish"]  # fmt: skip
then = next(a for a in answers if a["conversation"] == "multi-turn")
assert [str(live[k]) for k in keep] == [then[k] for k in keep]

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
for a in answers:
    print(f"{a['conversation']:>16}: chat route {float(a['chat_ms']):.0f} ms, completions route "
          f"{float(a['completions_ms']):.0f} ms")  # fmt: skip
print(f"this run, multi-turn: chat {live['chat_ms']:.0f} ms, completions {live['completions_ms']:.0f} ms")

# %% [markdown]
# The chat route has some extra work, rendering a template and tokenizing a few hundred
# characters on a worker thread, but that is small next to one forward pass of the model, and
# the rest is the same engine running the same tokens. The script's run, made on a quiet
# machine, shows no sign of that cost: the chat route was never the slower of the two, 328
# against 332 ms for the one-line question, 184 against 184 for the multi-turn conversation.
# Its widest gap, 408 against 460 ms for "developer + user", goes the other way, so it is not
# the template's doing; one run of each request cannot resolve a cost that small.
#
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9))
fig.suptitle("Day 37 — chat completions: the prompt the model sees (SmolLM2-135M)", fontsize=13)

ax = axes[0, 0]
segment = [sum(u == tok.bos_id for u in ids[: i + 1]) - 1 for i in range(len(ids))]  # turn of each token
palette = ["#8da0cb", "#66c2a5", "#fc8d62"]
for i, t in enumerate(ids):
    part = min(segment[i], 2)
    row, col = divmod(i, 9)
    ax.add_patch(plt.Rectangle((col, -row), 0.95, 0.9, color=palette[part], alpha=0.8 if t > 2 else 1.0))
    ax.text(col + 0.47, -row + 0.45, tok.token_text(t).replace("\n", "\\n"), ha="center", va="center",
            fontsize=7, rotation=0)  # fmt: skip
ax.set_xlim(0, 9)
ax.set_ylim(-((len(ids) - 1) // 9) - 0.3, 1.2)
ax.axis("off")
ax.set_title("'system + user' as the model sees it: system, user, generation prompt", fontsize=10)

ax = axes[0, 1]
names = [r["conversation"] for r in rows]
ax.bar(range(len(rows)), [r["template_tokens"] for r in rows], 0.4, label="our template ids")
ax.bar([i + 0.4 for i in range(len(rows))], [r["server_prompt_tokens"] for r in rows], 0.4,
       label="server's prompt_tokens", color="tab:orange")  # fmt: skip
for i, r in enumerate(rows):
    if r["default_system"] == "yes":
        ax.text(i + 0.2, r["template_tokens"] + 1, "default\nsystem", ha="center", fontsize=8)
ax.set_xticks([i + 0.2 for i in range(len(rows))], names, fontsize=8, rotation=15)
ax.set_ylabel("prompt tokens")
ax.set_ylim(0, 55)
ax.set_title("the server's count equals ours in every conversation")
ax.legend(fontsize=9, loc="upper right")

ax = axes[1, 0]
for j, (label, top, color) in enumerate((("with", with_gen, "tab:green"), ("without", without, "tab:red"))):
    tokens = list(top)[:5]
    ax.barh([i + 0.4 * j for i in range(5)], [torch.tensor(top[t]).exp().item() for t in tokens], 0.4,
            color=color, label=f"{label} the generation prompt")  # fmt: skip
    for i, t in enumerate(tokens):
        ax.text(0.01, i + 0.4 * j, repr(t)[:18], va="center", fontsize=8)
ax.set_yticks([])
ax.invert_yaxis()
ax.set_xlabel("probability of the first generated token")
ax.set_title("the first token's top 5, with and without the generation prompt")
ax.legend(fontsize=9, loc="lower right")

ax = axes[1, 1]
x = range(len(answers))
ax.bar([i - 0.2 for i in x], [int(a["chat_tokens"]) for a in answers], 0.4, label="chat route")
ax.bar([i + 0.2 for i in x], [int(a["bare_tokens"]) for a in answers], 0.4, label="bare rendering",
       color="tab:red")  # fmt: skip
ax.axhline(16, color="k", ls=":", lw=1)
ax.text(-0.4, 16.3, "max_tokens 16", fontsize=8)
ax.set_xticks(list(x), [a["conversation"] for a in answers], fontsize=8, rotation=15)
ax.set_ylabel("generated tokens")
ax.set_ylim(0, 22)
ax.set_title("the same answers; the bare prompt spends 4 tokens on a header")
ax.legend(fontsize=9, loc="upper right")
fig.tight_layout()
path = diagram_path("day37-chat.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %%
server.__exit__(None, None, None)  # the server and its engine loop stop here
print("server stopped; blocks still held:", engine.allocator.num_used)

# %% [markdown]
# ## In the real systems
#
# * **vLLM**'s chat route is `vllm/entrypoints/openai/serving_chat.py` (`OpenAIServingChat`).
#   It renders with the model's template through transformers' `apply_chat_template`, takes
#   `add_generation_prompt` (default true) and `continue_final_message` as request fields, and
#   lets a server start with `--chat-template` to replace the model's own. Ours takes neither
#   field: both would change the prompt, so `api.py` refuses them when set to anything but the
#   default, and the template is always the model directory's.
# * **SGLang**'s tokenizer manager tokenizes in the server process before the request reaches
#   the scheduler, the same split as our handler (render and tokenize on a worker thread, then
#   hand ids to the engine loop). **llama.cpp**'s `llama-server` reads the template from the
#   GGUF's metadata and runs it with its own Jinja implementation (the `--jinja` flag), falling
#   back to a list of built-in formats for models without one.
# * **transformers**' `apply_chat_template` defaults `add_generation_prompt` to False, which is
#   the root of section 4's mistake in client code; servers default it to true because a chat
#   request always wants the assistant's reply.
#
# ## Try it
#
# 1. **Double the BOS.** Encode `render(two)` with `add_bos=True` and send the ids to the
#    completions route with `logprobs=5`. The check: `check_prompt(two, ids_with_bos)` raises
#    with "27 tokens rendered, the server's prompt has 26", and the first token's scores differ
#    from section 4's `with_gen`.
# 2. **Render a role by the wrong name.** Replace `system` with `System` in `render` (the
#    template is case sensitive). The check: the assert of section 1 fails on every
#    conversation that has a system message, and `check_prompt` on the result raises with "the
#    same length, but the model saw different tokens" (a capital S is still one token here:
#    print the ids to confirm).
# 3. **Drop the default system message.** Render "user only" without it and send the ids to
#    the completions route. The check: the prompt is 21 tokens shorter than the server's 42,
#    and compare the answer with the chat route's "The answer is 4.".
