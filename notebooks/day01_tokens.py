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
# # Day 1 — Tokens
#
# The model never sees text. It sees integers from a vocabulary of 49,152, and everything the
# engine does later (prefill, decode, streaming, stop strings) is arithmetic on those integers.
# Today is the translation layer: `nanoserve.tokenizer.Tokenizer`.
#
# The package does not reimplement BPE; it hands the model directory's `tokenizer.json` to the
# `tokenizers` library. This notebook rebuilds each piece once, in a few lines, and checks that
# the few lines give exactly what the package gives:
#
# 1. bytes and the byte-level alphabet,
# 2. byte-pair merges, one word step by step, then whole texts,
# 3. special tokens,
# 4. SmolLM's digit split,
# 5. the ChatML chat template, rendered with jinja2,
# 6. the incremental detokenizer, which never cuts a character in half,
# 7. the day's table (`days/day01/tokenstats.py`) and its diagram.

# %%
import csv
import json
import sys

import jinja2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers

from nanocourse import REPO, diagram_path
from nanoserve.tokenizer import REPLACEMENT, Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day01"))
import tokenstats  # the day's script: the notebook prints the same table it writes

MODEL_DIR = fetch_default_model()
tok = Tokenizer.from_dir(MODEL_DIR)
spec = json.loads((MODEL_DIR / "tokenizer.json").read_text())
print("vocabulary:", tok.vocab_size, "tokens,", len(spec["model"]["merges"]), "merges")
print("model:", spec["model"]["type"], "| bos", tok.bos_id, "| eos", sorted(tok.eos_ids))

# %% [markdown]
# ## 1. Bytes first
#
# A byte-level BPE starts from UTF-8 bytes, so no text is ever out of vocabulary: the worst case
# is one token per byte. To keep the vocabulary printable, GPT-2 spells each of the 256 bytes
# as a visible character: printable Latin-1 bytes stand for themselves, the other 68 (space,
# control bytes, ...) are moved up to U+0100 and beyond. That is why a space shows up as `Ġ`
# (U+0120) in every token that starts a word.


# %%
def byte_alphabet() -> dict[int, str]:
    """GPT-2's visible stand-in for each byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    moved = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(moved)) for b in range(256)}


ALPHABET = byte_alphabet()
BYTE_OF = {c: b for b, c in ALPHABET.items()}


def spell(text: str) -> str:
    return "".join(ALPHABET[b] for b in text.encode("utf-8"))


moved_up = [b for b, c in ALPHABET.items() if ord(c) >= 256]
print(f"{256 - len(moved_up)} bytes stand for themselves, {len(moved_up)} move up; a space is {ALPHABET[32]}")
assert len(moved_up) == 68 and ALPHABET[32] == "\u0120"
for text in [" the", "naïve", "\n\n", "🚀"]:
    print(f"{text!r:9} bytes {text.encode('utf-8').hex(' '):14} -> {spell(text)!r}")

# %% [markdown]
# ## 2. Byte-pair merges
#
# `tokenizer.json` holds the vocabulary (string -> id) and 48,900 merges in priority order.
# Encoding a piece of text is: spell it in the byte alphabet, split it into characters, then
# repeatedly merge the adjacent pair whose merge comes earliest in the list, until no adjacent
# pair has a merge. Here is that loop, and one word going through it.

# %%
vocab = spec["model"]["vocab"]
ranks = {tuple(pair): rank for rank, pair in enumerate(spec["model"]["merges"])}


def bpe(piece: str, trace: list | None = None) -> list[str]:
    """Merge the best-ranked adjacent pair until none is left: 'Ġtoken' 'ization' for ' tokenization'."""
    parts = list(piece)
    while len(parts) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(parts, parts[1:])))
        if rank == len(ranks):
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if trace is not None:
            trace.append((rank, i, list(parts)))  # the merge, where it happened, the result
    return parts


trace = []
word = spell(" tokenization")
parts = bpe(word, trace)
print(f"start        {' '.join(word)}")
for rank, _, step in trace:
    print(f"merge #{rank:<5} {' '.join(step)}")
ids = [vocab[p] for p in parts]
print(len(word), "characters,", len(trace), "merges,", len(parts), "tokens")
print("ids:", ids, "| Tokenizer.encode:", tok.encode(" tokenization"))
assert ids == tok.encode(" tokenization") and (len(word), len(trace), len(parts)) == (13, 11, 2)

# %% [markdown]
# Eleven merges turn thirteen characters into two tokens. A merge's rank is the order in which
# training learned it, so the low ranks that act first here (`Ġ t` #0, `o n` #6, `a t` #9, `e n`
# #12) are pairs that were common everywhere, and the last two (#2769, #9372) assemble the word.
#
# Whole texts are first cut into pieces (the *pre-tokenizer*: roughly words with their leading
# space, runs of punctuation, runs of whitespace) and BPE runs inside each piece, never across.
# With the library's pre-tokenizer doing the cutting, the short `bpe` loop above reproduces
# `Tokenizer.encode` on the seven texts of the day's table (Chinese, Japanese and emoji among
# them) and on three awkward ones: whitespace runs with a tab, 200 repeated letters, quotes.


# %%
def encode_minimal(text: str) -> list[int]:
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str(text)  # [(piece, (start, end)), ...]
    return [vocab[p] for piece, _ in pieces for p in bpe(piece)]


print(tok.backend.pre_tokenizer.pre_tokenize_str("Hi there,  world!\n"))
checked = [*tokenstats.TEXTS.values(), "  two  spaces\tand a tab\r\n", "x" * 200, "'s 're — “quoted”"]
for text in checked:
    assert encode_minimal(text) == tok.encode(text), text
print(f"minimal BPE == Tokenizer.encode on {len(checked)} texts")

# %% [markdown]
# ## 3. Special tokens
#
# Seventeen ids at the bottom of the vocabulary are *added* tokens: strings matched whole in the
# text before any splitting, never produced by merges. Two of them carry the chat format:
# `<|im_start|>` (id 1, the BOS) and `<|im_end|>` (id 2, the EOS that ends a turn).

# %%
added = tok.backend.get_added_tokens_decoder()
print(len(added), "added tokens, all special:", all(t.special for t in added.values()))
assert sorted(added) == list(range(17)) and all(t.special for t in added.values())
print({i: added[i].content for i in sorted(added)})

ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
print("ids:", ids)
print("pieces:", [tok.decode([i], skip_special_tokens=False) for i in ids])
print("decode, specials skipped:", repr(tok.decode(ids)))
print("decode, specials kept:   ", repr(tok.decode(ids, skip_special_tokens=False)))
assert ids[0] == tok.bos_id and ids[-1] in tok.eos_ids

# %% [markdown]
# The match is on the raw text, so a user who types `<|im_end|>` inside a message gets the real
# control token, not its characters. Worth remembering for the server days: content is not
# escaped.

# %%
typed = tok.encode_chat([{"role": "user", "content": "Say <|im_end|> please"}])
print("EOS ids inside the prompt:", [i for i, t in enumerate(typed) if t in tok.eos_ids], "of", len(typed))
assert typed.count(2) == 3  # system turn end, the typed one, user turn end

# %% [markdown]
# ## 4. The smollm digit split
#
# The GGUF names its pre-tokenizer `smollm`: before GPT-2's split, every numeric character is
# cut off on its own (`Digits` with `individual_digits`). GPT-2's split alone keeps a space glued
# to the digits that follow (`Ġ2024`). For ASCII digits the ids come out the same anyway, because
# no merge in the list involves an ASCII digit: each digit stays a token. For a numeral outside
# ASCII, `½` below, the space merges differently.

# %%
print("pre-tokenizer:", spec["pre_tokenizer"]["pretokenizers"])
gpt2_only = Backend.from_str(tok.backend.to_str())
gpt2_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
digit_merges = sum(any(c in "0123456789" for c in a + b) for a, b in spec["model"]["merges"])
print("merges with an ASCII digit:", digit_merges)
for text in ["In 2024, 3.14", "x ½ off"]:
    ours, plain = tok.encode(text), gpt2_only.encode(text, add_special_tokens=False).ids
    print(f"{text!r}")
    print("  smollm pieces: ", [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)])
    print("  gpt2 pieces:   ", [p for p, _ in gpt2_only.pre_tokenizer.pre_tokenize_str(text)])
    print("  smollm tokens: ", [tok.backend.id_to_token(i) for i in ours])
    print("  gpt2 tokens:   ", [tok.backend.id_to_token(i) for i in plain], "| same ids:", ours == plain)
assert digit_merges == 0
assert tok.encode("x ½ off") != gpt2_only.encode("x ½ off", add_special_tokens=False).ids

# %% [markdown]
# ## 5. The chat template
#
# An instruct model was trained on conversations in one exact layout; the layout ships as a
# jinja2 template (`chat_template.jinja`, taken from the GGUF). SmolLM2's is ChatML, and it adds
# a default system prompt when the conversation does not start with one. Rendering it needs
# nothing but jinja2; the package renders it the way transformers does (sandboxed, `tojson`
# that does not escape HTML, `trim_blocks`), which for this template gives the same string.

# %%
source = (MODEL_DIR / "chat_template.jinja").read_text()
print(source)

# %%
messages = [{"role": "user", "content": "What is the capital of France?"}]
env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
rendered = env.from_string(source).render(messages=messages, add_generation_prompt=True)
print(rendered)
assert rendered == tok.apply_chat_template(messages)

with_system = [{"role": "system", "content": "You are terse."}, *messages]
assert env.from_string(source).render(messages=with_system, add_generation_prompt=True) == (
    tok.apply_chat_template(with_system)
)

# %% [markdown]
# The prompt ends with `<|im_start|>assistant\n`: the model's next token is the first of its
# answer. Its ids (the template writes the BOS itself, so `encode_chat` adds none), and what the
# 37 of them are spent on:

# %%
chat_ids = tok.encode_chat(messages)
print(len(chat_ids), "ids:", chat_ids)
print([tok.decode([i], skip_special_tokens=False) for i in chat_ids])
assert chat_ids == tok.encode(rendered, add_bos=False) and chat_ids.count(tok.bos_id) == 3
system_turn = chat_ids[: chat_ids.index(2) + 2]  # through the first <|im_end|> and its newline
question = tok.encode(messages[0]["content"])
print(f"default system turn {len(system_turn)} tokens, question {len(question)}, of {len(chat_ids)}")
assert (len(system_turn), len(question), len(chat_ids)) == (21, 7, 37)
assert chat_ids[len(system_turn) + 3 : len(system_turn) + 3 + len(question)] == question

# %% [markdown]
# ## 6. Streaming text out: the incremental detokenizer
#
# Generation produces one id at a time, and the user wants text as it comes. But a token is a
# run of *bytes*, and an emoji is four of them: after a space, SmolLM2 spells ` 🚀` as three
# tokens (bytes `20 f0 9f`, `9a`, `80`), and none of the three decodes to whole text on its own.
# Decoding each token alone prints U+FFFD where the pieces of a character should be.
#
# `IncrementalDetokenizer` decodes a short window of recent ids and holds back while the window
# ends in an unfinished character, so every piece it emits is final text.

# %%
stream_text = "Ship it 🚀🙌🏽!"
stream_ids = tok.encode(stream_text)
detok = tok.detokenizer()
held_bytes, emitted = [], []  # after each step: bytes taken but not yet emitted; the piece emitted
print(f"{'id':>6}  {'bytes':9} {'alone':7} {'emitted':9} held back")
for i in stream_ids:
    out = detok.add(i)
    emitted.append(out)
    held = detok.ids[detok.read :]
    held_bytes.append(sum(len(tok.backend.id_to_token(h)) for h in held))
    raw = bytes(BYTE_OF[c] for c in tok.backend.id_to_token(i))
    print(
        f"{i:>6}  {raw.hex(' '):9} {tok.decode([i])!r:7} {out!r:9} "
        f"{len(held)} tokens, {held_bytes[-1]} bytes, text {tok.decode(held)!r}"
    )
tail = detok.flush()
assert detok.text == stream_text and tail == ""
assert [tok.decode([i]) for i in stream_ids[3:6]] == [" " + REPLACEMENT, REPLACEMENT, REPLACEMENT]
assert emitted[3:6] == ["", "", " 🚀"] and max(held_bytes) == 4

# %% [markdown]
# The gate that matters is "every emitted piece is whole text, and the pieces add up to the
# decode". A detokenizer built the obvious way (emit each token's own decode at once) fails it:


# %%
def naive_stream(ids: list[int]) -> list[str]:
    return [tok.decode([i]) for i in ids]


def check_pieces_whole(pieces: list[str], text: str) -> None:
    if "".join(pieces) != text or any(REPLACEMENT in p for p in pieces):
        bad = [p for p in pieces if REPLACEMENT in p]
        raise AssertionError(f"{len(bad)} of {len(pieces)} pieces are broken characters: {''.join(pieces)!r}")


detok = tok.detokenizer()
check_pieces_whole([detok.add(i) for i in stream_ids] + [detok.flush()], stream_text)
print("incremental detokenizer: every piece whole")
try:
    check_pieces_whole(naive_stream(stream_ids), stream_text)
except AssertionError as e:
    print("naive detokenizer:", e)
else:
    raise RuntimeError("the naive detokenizer should have split the emoji")

# %% [markdown]
# If the stream stops in the middle of a character (a length limit hit after two of the
# rocket's three tokens), `flush` gives back what `decode` would: the replacement character.

# %%
detok = tok.detokenizer()
cut = stream_ids[:5]  # 'Ship it' then two of the three tokens of ' 🚀'
print([detok.add(i) for i in cut], "flush ->", repr(detok.flush()))
assert detok.text == tok.decode(cut)

# %% [markdown]
# ## 7. The day's table: what a token costs
#
# `days/day01/tokenstats.py` tokenizes a fixed set of texts. English packs about four bytes
# into a token (4.11); the numbers row drops to 1.55, since every digit is a token of its own;
# every Chinese and Japanese character is three UTF-8 bytes, and most of their tokens are only
# part of a character (`partial_tokens`: tokens that do not decode to whole text alone). The chat
# row is the one-question prompt above: 37 tokens, of which the question is 7 and the default
# system turn 21.

# %%
rows = tokenstats.tokenstats_rows(tok)
cols = list(rows[0])
print(" | ".join(f"{c:>15}" for c in cols))
for r in rows:
    print(" | ".join(f"{r[c]!s:>15}" for c in cols))
with open(tokenstats.CSV) as f:
    committed = list(csv.DictReader(f))
assert [{k: str(v) for k, v in r.items()} for r in rows] == committed, "rerun days/day01/tokenstats.py"
assert all(r["round_trip"] == "yes" for r in rows)

# %% [markdown]
# Over the whole vocabulary: how many bytes does a token hold?

# %%
token_bytes = {t: len(t) for t in vocab}  # one alphabet character per byte
lengths = [token_bytes[t] for t in vocab if vocab[t] not in added]
hist = {n: lengths.count(n) for n in range(1, max(lengths) + 1)}
print("tokens by length in bytes:", {n: c for n, c in hist.items() if c})
print("mean bytes per vocabulary token:", round(sum(lengths) / len(lengths), 2))
four_to_seven = sum(hist[n] for n in range(4, 8))
print(f"4 to 7 bytes long: {four_to_seven:,} of {len(lengths):,} ({four_to_seven / len(lengths):.0%})")
longest = max(lengths)
print("longest:", longest, "bytes:", [t for t in vocab if token_bytes[t] == longest])
assert [t for t in vocab if token_bytes[t] == longest] == ["Ċ" + "Ġ" * 80]

# %% [markdown]
# ## 8. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9))

ax = axes[0, 0]
kinds = [r["kind"] for r in rows]
y = range(len(rows))
ax.barh([i + 0.2 for i in y], [r["bytes"] for r in rows], height=0.4, label="UTF-8 bytes")
ax.barh([i - 0.2 for i in y], [r["tokens"] for r in rows], height=0.4, label="tokens")
for i, r in enumerate(rows):
    ax.text(max(r["bytes"], r["tokens"]) + 2, i, f"{r['bytes_per_token']} B/tok", va="center", fontsize=9)
ax.set_yticks(list(y), kinds)
ax.invert_yaxis()
ax.set_xlim(0, 215)
ax.set_xlabel("count")
ax.set_title("Bytes and tokens per text (tokenstats.py)")
ax.legend(loc="upper right")

ax = axes[0, 1]
ax.bar(list(hist), list(hist.values()), color="tab:green")
ax.set_yscale("log")
ax.set_xlabel("token length (bytes)")
ax.set_ylabel("tokens in the vocabulary (log)")
ax.set_title(f"Token lengths over the vocabulary ({len(lengths):,} BPE tokens)")

ax = axes[1, 0]
ax.semilogy(range(1, len(trace) + 1), [rank + 1 for rank, _, _ in trace], marker="o")
for k, (rank, i, step) in enumerate(trace, start=1):
    ax.annotate(
        f"{step[i]} (#{rank})",
        (k, rank + 1),
        textcoords="offset points",
        xytext=(-12, 8) if k % 2 else (4, -12),  # alternate above / below-right so labels do not collide
        fontsize=8,
    )
ax.set_xlabel("merge step on ' tokenization' (13 characters -> 2 tokens)")
ax.set_ylabel("merge rank + 1 (log)")
ax.set_xlim(0.5, len(trace) + 1.2)
ax.set_title("BPE: frequent pairs merge first, whole words last")

ax = axes[1, 1]
labels = [bytes(BYTE_OF[c] for c in tok.backend.id_to_token(i)).hex(" ") for i in stream_ids]
ax.bar(range(len(stream_ids)), held_bytes, color="tab:red", label="bytes held back after this token")
for k, piece in enumerate(emitted):
    if piece:
        shown = "".join(c if ord(c) < 0x2000 else f"U+{ord(c):X}" for c in piece)
        ax.annotate(repr(shown), (k, 0.05), rotation=90, ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(len(stream_ids)), labels, rotation=60, ha="right", fontsize=8)
ax.set_xlabel("token streamed (its bytes, hex)")
ax.set_ylabel("bytes held back")
ax.set_ylim(0, 5)
ax.legend(loc="upper right", title="text = piece emitted", fontsize=8, title_fontsize=8)
ax.set_title("Detokenizer streaming 'Ship it ' + emoji + '!'")

fig.suptitle("Day 1: tokens (SmolLM2-135M-Instruct tokenizer)", fontsize=14)
fig.tight_layout()
png = diagram_path("day01-tokens.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **transformers** compiles chat templates in `_compile_jinja_template`
#   (`src/transformers/utils/chat_template_utils.py`): an `ImmutableSandboxedEnvironment` with
#   `trim_blocks`, `lstrip_blocks` and jinja's `loopcontrols`, and a `tojson` filter swapped for
#   one that leaves HTML characters alone. `nanoserve.tokenizer` builds the same environment; what
#   it leaves out is transformers' `AssistantTracker`, a `{% generation %}` tag that records which
#   characters the assistant wrote (a training concern). transformers' streaming helper,
#   `TextStreamer` (`generation/streamers.py`), re-decodes its cache and prints only up to the last
#   space unless the new text ends a line, ends in a CJK character, or is only letters, marks,
#   numbers and spaces: it holds back words, where ours holds back only unfinished characters.
# * **vLLM** chooses a detokenizer per request in `IncrementalDetokenizer.from_new_request`
#   (`vllm/v1/engine/detokenizer.py`). `FastIncrementalDetokenizer` drives the `tokenizers`
#   library's own `DecodeStream`; `SlowIncrementalDetokenizer` keeps a `prefix_offset` and a
#   `read_offset` into the ids, the two-offset window our `IncrementalDetokenizer` uses. The fast
#   one first steps the stream through the shortest tail of the prompt (at least four tokens, at
#   most 23) that decodes without U+FFFD, so the first generated token is decoded in context;
#   ours starts from the first generated token. With stop strings that must not be shown it also
#   holds back the longest stop string's length minus one characters.
# * **llama.cpp** runs BPE in its own C++ (`src/llama-vocab.cpp`). `llm_tokenizer_bpe` picks a
#   list of split regexes from the GGUF's `tokenizer.ggml.pre`; `LLAMA_VOCAB_PRE_TYPE_SMOLLM`
#   shares StarCoder's list, `\p{N}` first and GPT-2's pattern second: the `Digits` then
#   `ByteLevel` sequence of section 4. Its merges come off a priority queue ordered by rank
#   (`llm_bigram_bpe`) rather than from the rescan of every pair our `bpe` does per merge.
# * **transformers' GGUF loader** has no `smollm` entry in its split table
#   (`GGUF_PRE_TOKENIZER_SPLITS`, `integrations/gguf/gguf_tokenizer_mapping.py`, as of
#   transformers 5.25.0, the version installed here), so a tokenizer it builds from this GGUF
#   does not cut numerals off first;
#   `tests/test_tokenizer.py::test_numbers_are_split_one_by_one_unlike_transformers_gguf`
#   pins the ids that differ (` ½` among them).
# * **nano-vllm** does not stream: `LLMEngine` (`nanovllm/engine/llm_engine.py`) loads
#   `AutoTokenizer`, encodes each prompt, and calls `decode` once per finished sequence; its
#   `example.py` renders the chat template through transformers' `apply_chat_template`.
#
# ## Try it
#
# 1. **Break the detokenizer on purpose.** In a new cell, make it emit every token at once:
#
#    ```python
#    from nanoserve.tokenizer import IncrementalDetokenizer
#    def eager(self, token_id):
#        self.ids.append(int(token_id))
#        return self._emit(self._decode(self.ids[self.prefix :]))
#    IncrementalDetokenizer.add = eager
#    ```
#
#    and rerun section 6's gate cell: `check_pieces_whole` raises `6 of 14 pieces are broken
#    characters`. The package's tests catch it too: put the same lines inside
#    `def pytest_configure(config):` in a file `breakdetok.py` and run
#    `PYTHONPATH=. pytest -p breakdetok tests/test_tokenizer.py -k "emoji or streamed"`: two of
#    the three tests fail. Restart the kernel to undo the patch.
# 2. **Compare with the library's decoder.** `tokenizers.decoders.DecodeStream(skip_special_tokens=True)`
#    has `step(tokenizer, id)`, which returns the new text or `None`. Step it through `stream_ids`
#    with `tok.backend` and assert `[piece or "" for piece in pieces] == emitted` (the list section
#    6 recorded). It holds: this is the object vLLM's fast detokenizer wraps.
# 3. **Price a text of your own.** `python days/day01/tokenstats.py --text mine=FILE --out
#    /tmp/stats.csv` adds a row named `mine` before the chat row. Its `round_trip` must be `yes`,
#    and `grep -v '^mine,' /tmp/stats.csv | diff - days/day01/day-01-tokenstats.csv` must print
#    nothing: the other rows do not move.
