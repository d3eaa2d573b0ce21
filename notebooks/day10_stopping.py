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
# # Day 10 — Stopping and streaming detokenization
#
# Day 9 picked the next token. A request also has to end, and while it runs the user should see
# its text as it comes, without ever seeing something that has to be taken back. A request ends
# in one of four ways: the model emits its end-of-sequence token, the text contains one of the
# request's stop strings, it has used its `max_tokens`, or it has reached the end of the
# context. The first and the last two are about token ids and counts; the stop string is about
# text, and text arrives in pieces that do not line up with characters, let alone with words.
#
# Two package pieces do the text side, chained for every token: `IncrementalDetokenizer.add`
# (Day 1) turns an id into the text it makes final, and `StopStrings.feed`
# (`nanoserve/stopping.py`) decides how much of that text is safe to show.
#
# 1. the day's six cases, run once (`days/day10/streams.py`),
# 2. the end-of-sequence token,
# 3. streaming text: the idea in a few lines, against the package's detokenizer,
# 4. stop strings: the idea in a few lines, against `StopStrings`, on a stop split across tokens,
# 5. two stop checkers built wrong, and the gate that catches them,
# 6. property tests (hypothesis) that find each planted bug by themselves,
# 7. the table, the same text without streaming, and the diagram.

# %%
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from hypothesis import Verbosity, find, given, settings
from hypothesis import strategies as st
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, read_csv
from nanoserve.generate import decode_loop, greedy_tokens
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.stopping import StopStrings, first_stop
from nanoserve.tokenizer import REPLACEMENT, Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day10"))
import streams  # the day's script: the notebook prints the same table it writes

MODEL_DIR = fetch_default_model()
tok = Tokenizer.from_dir(MODEL_DIR)
t0 = time.perf_counter()
model = load_model(MODEL_DIR)
print(f"loaded in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ## 1. Six requests
#
# Each case of the day's script is a chat prompt, its stop strings and a token budget. The
# tokens come from the package's eager greedy loop (`decode_loop`); every token goes through the
# detokenizer and then the stop checker, the end token checked first. The rest of the notebook takes these
# six streams apart.

# %%
t0 = time.perf_counter()
results = streams.streams(model, tok)
print(f"{len(results)} cases, {sum(len(s.ids) for s in results)} tokens in {time.perf_counter() - t0:.1f} s")
for s in results:
    stops = ", ".join(repr(x) for x in s.case.stops) or "none"
    print(f"{s.case.name:14s} stops {stops:13s} budget {s.case.max_tokens:2d}:", end=" ")
    print(f"{len(s.ids):2d} tokens, {s.finish}")
by_name = {s.case.name: s for s in results}
assert [s.finish for s in results] == ["eos", "stop", "stop", "stop", "length", "length"]

# %% [markdown]
# ## 2. The end-of-sequence token
#
# The model ends its turn by emitting `<|im_end|>`, id 2. `Tokenizer.eos_ids` collects every end
# id that `generation_config.json`, `config.json` and `tokenizer_config.json` name; for SmolLM2
# the three agree on one. The loop yields the id and returns; the script ends the case there
# and never hands the id to the detokenizer, so no text comes of it.
# (With special tokens skipped it would decode to nothing anyway.)

# %%
eos_case = by_name["eos"]
print("eos_ids:", sorted(tok.eos_ids), "| id 2 is", repr(tok.decode([2], skip_special_tokens=False)))
print("ids:", eos_case.ids)
print("text:", repr(eos_case.text))
print("decode([2]) with special tokens skipped:", repr(tok.decode([2])))
assert tok.eos_ids == {2} and eos_case.ids[-1] == 2 and len(eos_case.steps) == len(eos_case.ids) - 1

# %% [markdown]
# `ignore_eos` (a request field; the benchmarks use it to get a fixed number of tokens) makes
# the loop step over the end token. What comes next is the model carrying on in the chat layout
# it was trained on: a newline, a second end token, then a system turn opened and closed at
# once. Nothing a user should see, which is why the end token ends the request.

# %%
prompt = tok.encode_chat([{"role": "user", "content": eos_case.case.prompt}])
on = list(decode_loop(model, prompt, SamplingParams(max_tokens=len(eos_case.ids) + 6, ignore_eos=True)))
print("with ignore_eos:", on)
print(repr(tok.decode(on, skip_special_tokens=False)))
assert on[: len(eos_case.ids)] == eos_case.ids and len(on) == len(eos_case.ids) + 6

# %% [markdown]
# ## 3. Streaming text
#
# Byte-level BPE splits text into runs of bytes, and a character outside ASCII is two to four
# bytes that may land in different tokens. The Chinese answer shows it from its first token:
# `如` is three bytes, one in the first token and two in the second, and `意` comes one byte at
# a time. A token whose bytes end in the middle of a character decodes to U+FFFD on its own.
#
# The plainest correct streamer decodes everything generated so far at every step and shows the
# part that is new, unless the decode ends in U+FFFD (an unfinished character: wait for more).


# %%
def redecode_stream(ids: list[int]) -> tuple[list[str], int]:
    """Pieces of text, one per id, plus a final flush; and how many ids it decoded in all."""
    pieces, shown, work = [], "", 0
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        work += n
        if text.endswith(REPLACEMENT):
            pieces.append("")  # an unfinished character: show nothing yet
        else:
            pieces.append(text[len(shown) :])
            shown = text
    pieces.append(tok.decode(ids)[len(shown) :])  # the flush
    return pieces, work


def package_stream(ids: list[int]) -> list[str]:
    d = tok.detokenizer()
    return [d.add(i) for i in ids] + [d.flush()]


zh = by_name["chinese"]
mine, work = redecode_stream(zh.ids)
print(f"{'id':>6} {'bytes':>5} {'alone':>7} {'open':>4}  shown")
for st_, piece in zip(zh.steps[:12], mine):
    alone = tok.decode([st_.token])
    print(
        f"{st_.token:>6} {streams.token_bytes(tok, st_.token):>5} {alone!r:>7} {st_.open_bytes:>4}  {piece!r}"
    )
for s in results:
    assert redecode_stream(s.ids[: len(s.steps)])[0] == package_stream(s.ids[: len(s.steps)])
print("re-decoding everything == IncrementalDetokenizer, piece for piece, on all six streams")
print(
    f"ids decoded for the {len(zh.ids)} tokens: re-decoding {work}, the package's window {zh.window_decodes}"
)
assert work == len(zh.ids) * (len(zh.ids) + 1) // 2 and zh.window_decodes < work / 3

# %% [markdown]
# The `open` column is the detokenizer holding bytes of a character that is not finished: the
# step shows nothing, and the next one shows the whole character. Re-decoding everything works
# but its cost grows with the text: step n decodes n ids, n(n+1)/2 in all. The package keeps a
# window instead (vLLM's prefix and read offsets): it decodes only the ids since the last clean
# character boundary, twice a step, so the work per token stays flat. Both give the same
# pieces on all six streams.
#
# When the budget runs out in the middle of a character, `flush` gives back what `decode` gives
# for those bytes: the replacement character. The emoji case ends that way: sixteen tokens are
# five whole emoji of three tokens each and the first token of a sixth.

# %%
em = by_name["emoji_cut"]
print("emoji tokens:", [tok.backend.id_to_token(i) for i in em.ids[:4]], "...")
print("text:", repr(em.text), "| ends open:", em.text.endswith(REPLACEMENT))
assert em.text == tok.decode(em.ids) and em.text.endswith(REPLACEMENT) and len(em.ids) == 16

# %% [markdown]
# ## 4. Stop strings
#
# A stop string can begin in one token and end in another, and it can also sit inside a single
# token. The text in front of it must be shown and the stop string itself never (the OpenAI
# convention). So while the text so far ends with something that could still grow into a stop
# string, that tail waits; once it is clear either way, it is released or the request stops.
# In a few lines:


# %%
class TinyStops:
    def __init__(self, stops):
        self.stops, self.text, self.shown = tuple(stops), "", 0

    def feed(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        cut = first_stop(self.text, self.stops)  # the stop complete first wins
        if cut is not None:
            return self.text[self.shown : cut], True
        wait = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        out = self.text[self.shown : len(self.text) - wait]
        self.shown = len(self.text) - wait
        return out, False

    def flush(self) -> str:
        return self.text[self.shown :]


def run(make, pieces, stops) -> tuple[str, bool]:
    """Feed pieces to a stop checker until it stops: (text released, stopped)."""
    s, out = make(stops), ""
    for piece in pieces:
        text, stopped = s.feed(piece)
        out += text
        if stopped:
            return out, True
    return out + s.flush(), False


sea = by_name["across_tokens"]
print(f"stop {sea.case.stops[0]!r}; {'token':>10} -> released | held")
for st_ in sea.steps:
    print(f"{st_.piece!r:>28} -> {st_.released!r:26} | {st_.held!r}")
for s in results:
    pieces = [st_.piece for st_ in s.steps]
    assert run(TinyStops, pieces, s.case.stops) == run(StopStrings, pieces, s.case.stops)
print("TinyStops == StopStrings on the six streams")
print("text:", repr(sea.text))

# %% [markdown]
# Twice ` the` arrives and `the` waits (it could be the start of `the shore`): the first time
# ` sea` follows and `the sea` goes out, the second time ` shore` completes the stop string and
# the request ends with the text in front of it. Even the `t` at the end of ` silent` waits one
# token, since a stop string starting with `t` could begin there. What waits is only ever a
# tail that could still grow into a stop string, three characters at most on this stream. The
# other two cases with stops show the other shapes: `Par` sits inside the one token ` Paris`
# (the cut falls in the middle of a token), and `\n3` is a newline token followed by a digit.

# %%
for name in ("inside_token", "newline_digit"):
    s = by_name[name]
    print(f"{name}: {[st_.piece for st_ in s.steps]} -> {s.text!r}")
print(
    "tokens the stop string spans:",
    {s.case.name: streams.stop_span_tokens(tok, s) for s in results if s.finish == "stop"},
)
assert by_name["inside_token"].text == "The capital of France is "

# %% [markdown]
# ## 5. Wrong on purpose
#
# Two stop checkers that look plausible. The first looks for stop strings only inside the
# newest piece, which is right whenever a stop string arrives in one token. The second looks at
# all the text but never holds anything back. The gate is the definition itself: the released
# text must be the text in front of the first stop string to be completed, and nothing else.


# %%
class NewestPieceOnly:
    """Planted bug: a stop string split over two pieces goes unseen."""

    def __init__(self, stops):
        self.stops = tuple(stops)

    def feed(self, piece):
        cut = first_stop(piece, self.stops)
        return (piece, False) if cut is None else (piece[:cut], True)

    def flush(self):
        return ""


class NoHoldBack(StopStrings):
    """Planted bug: releases everything at once, so the start of a stop string is shown."""

    def _holdback(self, text):
        return 0


def check_stops_hidden(released: tuple[str, bool], pieces: list[str], stops) -> None:
    """The released text is what comes before the stop string that is complete first."""
    text = "".join(pieces)
    for n in range(1, len(text) + 1):  # grow the text a character at a time
        done = [s for s in stops if text[:n].endswith(s)]
        if done:
            want = (text[: n - max(map(len, done))], True)
            break
    else:
        want = (text, False)
    if released != want:
        raise AssertionError(f"released {released[0]!r} (stopped={released[1]}), want {want[0]!r}")


sea_pieces = [st_.piece for st_ in sea.steps]
for make in (StopStrings, TinyStops, NewestPieceOnly, NoHoldBack):
    try:
        check_stops_hidden(run(make, sea_pieces, sea.case.stops), sea_pieces, sea.case.stops)
        print(f"{make.__name__:16s} passes")
    except AssertionError as e:
        print(f"{make.__name__:16s} caught: {e}")

# %% [markdown]
# On this stream the stop string comes in two tokens, so the newest-piece checker never sees
# it and shows all of it. The checker without hold-back fails the same way for a different
# reason: it lets `the` out at once, so when ` shore` arrives there is nothing left to join it
# to. Both would pass every stream whose stop strings arrive in one token. A bug like that
# needs a particular arrangement of pieces, which a hand-written test can easily miss; a
# property test goes looking for one.
#
# ## 6. Property tests
#
# hypothesis draws a text over a three-letter alphabet, one or two short stop strings, and
# random cut points that turn the text into pieces, then checks the gate. `derandomize=True`
# makes the search the same on every run, and `database=None` keeps it from writing a
# `.hypothesis` folder. Each checker gets 200 examples.

# %%
ALPHABET = "ab\n"


@st.composite
def streamed(draw):
    text = draw(st.text(alphabet=ALPHABET, max_size=16))
    stops = draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), min_size=1, max_size=2))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], stops


QUIET = settings(max_examples=200, derandomize=True, database=None, deadline=None, verbosity=Verbosity.quiet)


def property_holds(make) -> bool:
    @QUIET
    @given(streamed())
    def prop(case):
        pieces, stops = case
        check_stops_hidden(run(make, pieces, stops), pieces, stops)

    try:
        prop()
        return True
    except AssertionError:
        return False


def smallest_failure(make):
    def fails(case):
        try:
            check_stops_hidden(run(make, *case), *case)
            return False
        except AssertionError:
            return True

    return find(streamed(), fails, settings=QUIET)


for make in (StopStrings, TinyStops, NewestPieceOnly, NoHoldBack):
    ok = property_holds(make)
    print(f"{make.__name__:16s} property holds on 200 examples: {ok}")
    if not ok:
        pieces, stops = smallest_failure(make)
        print(f"{'':16s} smallest failure: pieces {pieces}, stops {stops} -> {run(make, pieces, stops)}")
assert property_holds(StopStrings) and property_holds(TinyStops)
assert not property_holds(NewestPieceOnly) and not property_holds(NoHoldBack)

# %% [markdown]
# hypothesis shrinks what it finds to the smallest case it can: two pieces and a two-character
# stop string split between them, for both bugs. The same search holds the detokenizer to its
# promise, on texts drawn from letters, a space, a newline, an accented letter, a Chinese
# character and an emoji: the pieces join up to the text, and no piece holds U+FFFD. Decoding
# each token alone fails it, and hypothesis finds the one character that shows it.

# %%
TEXT = st.text(alphabet="a \né漢🚀", min_size=1, max_size=8)


def check_pieces_whole(pieces: list[str], text: str) -> None:
    if "".join(pieces) != text or any(REPLACEMENT in p for p in pieces):
        raise AssertionError(f"pieces {pieces} for {text!r}")


def detok_holds(stream) -> bool:
    @QUIET
    @given(TEXT)
    def prop(text):
        check_pieces_whole(stream(tok.encode(text)), text)

    try:
        prop()
        return True
    except AssertionError:
        return False


def one_by_one(ids):
    return [tok.decode([i]) for i in ids]


def broken(text):
    try:
        check_pieces_whole(one_by_one(tok.encode(text)), text)
        return False
    except AssertionError:
        return True


print("IncrementalDetokenizer property holds:", detok_holds(package_stream))
print("re-decoding everything property holds:", detok_holds(lambda ids: redecode_stream(ids)[0]))
print("one token at a time property holds:   ", detok_holds(one_by_one))
worst = find(TEXT, broken, settings=QUIET)
print(f"smallest failure: {worst!r} = tokens {tok.encode(worst)} -> pieces {one_by_one(tok.encode(worst))}")
assert detok_holds(package_stream) and not detok_holds(one_by_one)

# %% [markdown]
# ## 7. The table
#
# `days/day10/streams.py` writes one row per case. Every column is a count or text, so the
# committed CSV is what this notebook must reproduce: `stop_span_tokens` is how many tokens the
# matched stop string came from, `max_held_chars` the most text the stop checker held at once,
# `silent_steps` the tokens after which nothing could be shown, `split_chars` the characters
# whose bytes came in two or more tokens, and the last two columns the ids decoded by the
# package's window against re-decoding everything.

# %%
rows = [streams.row(tok, s) for s in results]
cols = [c for c in rows[0] if c != "text"]
print(" | ".join(cols))
for r in rows:
    print(" | ".join(str(r[c]) for c in cols))
assert as_text(rows) == read_csv(streams.CSV), "rerun streams.py"

# %% [markdown]
# Streaming must not change what the user ends up with. Without it, a request would run its
# whole budget with `greedy_tokens` (the same loop, stopping only at the end token), decode every
# id once, and cut the text at the first stop string. Each of the six cases gives the streamed
# text exactly, and the streamed ids are the start of the unstreamed ones:

# %%
for s in results:
    prompt = tok.encode_chat([{"role": "user", "content": s.case.prompt}])
    ids = greedy_tokens(model, prompt, s.case.max_tokens, tok.eos_ids)
    whole = tok.decode(ids)
    cut = first_stop(whole, s.case.stops)
    text = whole if cut is None else whole[:cut]
    print(f"{s.case.name:14s} {len(ids):2d} ids decoded at once, cut at {cut}: {text == s.text}")
    assert ids[: len(s.ids)] == s.ids and text == s.text

# %% [markdown]
# ## 8. The diagram

# %%
from matplotlib.patches import Patch

fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))


def label(piece: str) -> str:
    return repr(piece)[1:-1] if piece else "·"


ax = axes[0, 0]
xs = range(len(sea.steps))
released = [len(st_.released) for st_ in sea.steps]
held = [len(st_.held) for st_ in sea.steps]
ax.bar(xs, released, color="tab:green", label="characters released")
ax.bar(xs, held, bottom=released, color="tab:orange", label="characters held: could start the stop string")
ax.set_xticks(list(xs), [label(st_.piece) for st_ in sea.steps], rotation=70, fontsize=8)
ax.annotate(
    f"{sea.case.stops[0]!r} complete:\nstop, nothing released",
    (len(sea.steps) - 1, 0.2),
    xytext=(len(sea.steps) - 6, 9),
    arrowprops=dict(arrowstyle="->"),
    fontsize=9,
)
ax.set_ylim(0, 12.5)
ax.set_ylabel("characters")
ax.set_xlabel("token (its text)")
ax.set_title(f"Stop string {sea.case.stops[0]!r} split over two tokens")
ax.legend(loc="upper left", fontsize=8)

ax = axes[0, 1]
xs = range(len(zh.steps))
ax.bar(
    xs, [st_.open_bytes for st_ in zh.steps], color="tab:red", label="bytes of an unfinished character held"
)
ax.plot(xs, [len(st_.piece) for st_ in zh.steps], "ko-", ms=4, label="characters shown after this token")
ax.set_xticks(list(xs), [streams.token_bytes(tok, st_.token) for st_ in zh.steps], fontsize=8)
ax.set_xlabel("token (how many UTF-8 bytes it carries)")
ax.set_ylabel("bytes / characters")
ax.set_title(f"The Chinese answer: {streams.split_chars(tok, zh.ids)} characters split across tokens")
ax.legend(loc="upper right", fontsize=8)
ax.set_ylim(0, 3.2)

ax = axes[1, 0]
names = [r["case"] for r in rows]
ys = range(len(rows))
redo, window = [r["redecode_decodes"] for r in rows], [r["window_decodes"] for r in rows]
ax.barh([y - 0.2 for y in ys], redo, height=0.4, color="tab:gray", label="re-decode everything: n(n+1)/2")
ax.barh([y + 0.2 for y in ys], window, height=0.4, color="tab:blue", label="IncrementalDetokenizer's window")
for y, r in zip(ys, rows):
    ax.text(r["redecode_decodes"] + 4, y - 0.2, f"{r['redecode_decodes']}", va="center", fontsize=8)
    ax.text(
        r["window_decodes"] + 4,
        y + 0.2,
        f"{r['window_decodes']} ({r['tokens']} tokens)",
        va="center",
        fontsize=8,
    )
ax.set_yticks(list(ys), names)
ax.invert_yaxis()
ax.set_xlim(0, max(redo) * 1.25)
ax.set_xlabel("token ids decoded to stream the case")
ax.set_title("Streaming cost: quadratic re-decode against the window")
ax.legend(loc="lower right", fontsize=8)

ax = axes[1, 1]
colors = {"eos": "tab:purple", "stop": "tab:orange", "length": "tab:gray"}
for y, (r, s) in enumerate(zip(rows, results)):
    for i, st_ in enumerate(s.steps):  # each token at its place: solid if it showed text, hatched if not
        if st_.released == "":
            ax.barh(y, 1, left=i, facecolor="w", edgecolor=colors[r["finish"]], hatch="////", lw=0.8)
        else:
            ax.barh(y, 1, left=i, color=colors[r["finish"]], edgecolor="white", linewidth=0.5)
    assert sum(st_.released == "" for st_ in s.steps) == r["silent_steps"]
    if r["finish"] == "eos":
        ax.barh(y, 1, left=len(s.steps), color="k")
    ax.text(
        r["tokens"] + 0.5, y, f"{r['finish']}: {r['text_chars']} characters shown", va="center", fontsize=8
    )
handles = [Patch(color=c, label=f"finish: {name}") for name, c in colors.items()]
handles.append(
    Patch(facecolor="w", edgecolor="k", hatch="////", label="tokens after which nothing new was shown")
)
handles.append(Patch(color="k", label="the end token (never decoded)"))
ax.legend(handles=handles, loc="upper right", fontsize=8)
ax.set_yticks(list(ys), names)
ax.invert_yaxis()
ax.set_xlim(0, 58)
ax.set_xlabel("generated tokens, in generation order (one cell each)")
ax.set_title("How each case ended")

fig.suptitle("Day 10: stopping and streaming detokenization (SmolLM2-135M-Instruct, greedy)", fontsize=14)
fig.tight_layout()
png = diagram_path("day10-stopping.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** checks stop strings on the decoded text in its front end.
#   `BaseIncrementalDetokenizer` (`vllm/v1/engine/detokenizer.py`) appends each new token's text
#   and calls `check_stop_strings`, which searches only the new characters plus a stop string's
#   length minus one before them. In the version we read it takes the first stop string of the
#   list that it finds there, where our `first_stop` takes the one completed first. While
#   streaming with the stop string hidden, `get_next_output_text` always withholds
#   `stop_buffer_length = max(len(s) for s in stop) - 1` characters, whatever the tail looks
#   like: with `the shore` that is 8 characters on every step, where ours held 3 at most and
#   usually none. `include_stop_str_in_output` keeps the stop string in the text. The end token
#   and `stop_token_ids` are decided on ids in the scheduler (`check_stop`,
#   `vllm/v1/core/sched/utils.py`), the same split as in `streams.stream_case`, where the end
#   id is checked before any text is made.
# * **llama.cpp**'s server keeps stop words in `task->params.antiprompt` and checks them in
#   `server_slot::find_stopping_strings` (`tools/server/server-context.cpp`), in two modes: a
#   full match, searched from one stop word plus the last token's length before the end, and a
#   partial one, `string_find_partial_stop`, for text that ends with the start of a stop word;
#   `n_sent_text` counts what has already been sent (its comment: to handle partial UTF-8 on
#   streaming). It compares bytes of a `std::string`, not characters, and among full matches
#   the one that starts first wins (`pos < stop_pos`).
# * **transformers**' `StopStringCriteria` (`generation/stopping_criteria.py`) decides on token
#   ids without decoding: for every vocabulary token it precomputes where that token could sit
#   inside each stop string (its `embedding_vec`), so the check is tensor operations that can be
#   compiled. It answers only "stop this row now?"; it cuts no text, so the returned ids still
#   end with the tokens that spell the stop string. `EosTokenCriteria` handles the end ids.
# * **nano-vllm** has no stop strings. `Scheduler.postprocess` (`nanovllm/engine/scheduler.py`)
#   ends a sequence when the token equals `self.eos`, the one id `LLMEngine` took from
#   `tokenizer.eos_token_id` (unless `ignore_eos`), or when it has `max_tokens`; the text is
#   decoded once, when the sequence is finished, so nothing is streamed and no character can be
#   cut.
#
# ## Try it
#
# 1. **Break the hold-back on purpose.** In a new cell run
#    `StopStrings._holdback = lambda self, text: 0` and rerun section 6's first cell: the line
#    for `StopStrings` now says `False`, with the smallest failure `pieces ['a', 'a'], stops
#    ['aa']`. The package's own tests catch it as well: put the same line inside
#    `def pytest_configure(config):` in a file `breakstop.py` and run
#    `PYTHONPATH=. pytest -p breakstop tests/test_stopping.py`: three of its five tests fail.
#    Restart the kernel to undo the patch.
# 2. **Which stop string wins.** `run(StopStrings, ["xabcd"], ["ab", "xabcd"])` is
#    `('x', True)`: `ab` is complete at the third character and `xabcd` only at the fifth.
#    Write a checker that cuts at the stop string that *starts* first, as llama.cpp's full match
#    does, and run `property_holds` on it. It returns `False`, and `smallest_failure` shows a
#    case where that rule gives a different answer for the same text cut into different pieces,
#    which is why ours counts from the end.
# 3. **Count the broken tokens.** How many of the 49,152 vocabulary ids decode, alone, to text
#    containing U+FFFD? `sum(REPLACEMENT in tok.decode([i]) for i in range(tok.vocab_size))`
#    must print 314; each of them is a token the detokenizer may have to sit on.
