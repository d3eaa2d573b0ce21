"""Day 10: where a stream of tokens ends, and what text it shows on the way.

Each case is a chat prompt, a list of stop strings and a token budget. The tokens come from the
eager greedy loop (`nanoserve.generate.decode_loop`); the text goes through the package's two
streaming pieces in the order a server needs: an end-of-sequence id ends the request before it is
decoded, every other id goes through `IncrementalDetokenizer.add` and then `StopStrings.feed`,
and a request that ends for another reason flushes both. One record per generated token keeps
what was released, what the stop checker was holding, and how many bytes of an unfinished
character the detokenizer was sitting on.

Every column is a count or a piece of text, so the CSV is the same on every machine where the
greedy tokens are (Day 7 checked those against transformers):

    finish            eos | stop | length
    stop_span_tokens  how many generated tokens the matched stop string's characters came from
    max_held_chars    the most text the stop checker held back at once
    silent_steps      tokens after which nothing new could be shown
    split_chars       characters of the decoded text whose bytes arrived in two or more tokens
    ends_open         the budget ran out inside a character: the flush shows U+FFFD, as decode does
    window_decodes    token ids the detokenizer decoded in all (its short window, twice a step)
    redecode_decodes  the same for re-decoding everything so far at every step: n(n+1)/2

    python days/day10/streams.py                           # six cases -> day-10-streams.csv
    python days/day10/streams.py --max-tokens 64 --out /tmp/streams.csv
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from nanocourse import write_csv
from nanoserve.generate import decode_loop
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.stopping import StopStrings, first_stop
from nanoserve.tokenizer import REPLACEMENT, Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-10-streams.csv"


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    stops: tuple[str, ...] = ()
    max_tokens: int = 32


CASES = [
    Case("eos", "What is the capital of France?"),
    Case("inside_token", "What is the capital of France?", ("Par",)),
    Case("across_tokens", "Write a haiku about the sea.", ("the shore",)),
    Case("newline_digit", "List three colors, one per line.", ("\n3",)),
    Case("chinese", "How do you say 'good morning' in Chinese?", max_tokens=24),
    Case("emoji_cut", "Give me three emoji that describe the ocean.", max_tokens=16),
]


@dataclass
class Step:
    token: int
    piece: str  # what the detokenizer made final with this token ("" while a character is open)
    released: str  # what the stop checker let out
    held: str  # what the stop checker is holding after this token
    open_bytes: int  # bytes of an unfinished character the detokenizer is holding


@dataclass
class Stream:
    case: Case
    ids: list[int]
    steps: list[Step]
    text: str  # everything released, the final flush included
    finish: str
    window_decodes: int
    stop_at: int | None = None  # character offset of the matched stop string in the raw text
    raw: str = field(default="")  # decode of every generated id (special tokens skipped)


def token_bytes(tok: Tokenizer, token_id: int) -> int:
    """UTF-8 bytes a byte-level token stands for: one alphabet character per byte."""
    return len(tok.backend.id_to_token(token_id))


def stream_case(model, tok: Tokenizer, case: Case) -> Stream:
    """Run one case through the eager loop, the detokenizer and the stop checker."""
    prompt = tok.encode_chat([{"role": "user", "content": case.prompt}])
    detok, stops = tok.detokenizer(), StopStrings(case.stops)
    decoded = [0]

    def counting(ids, _decode=detok._decode):
        decoded[0] += len(ids)
        return _decode(ids)

    detok._decode = counting  # count the ids it decodes; the method itself is unchanged
    ids, steps, text, finish = [], [], "", "length"
    for token in decode_loop(model, prompt, SamplingParams(max_tokens=case.max_tokens), tok.eos_ids):
        ids.append(token)
        if token in tok.eos_ids:
            finish = "eos"
            break
        piece = detok.add(token)
        released, stopped = stops.feed(piece)
        text += released
        open_bytes = sum(token_bytes(tok, i) for i in detok.ids[detok.read :])
        steps.append(Step(token, piece, released, stops.held, open_bytes))
        if stopped:
            finish = "stop"
            break
    if finish != "stop":
        tail, _ = stops.feed(detok.flush())
        text += tail + stops.flush()
    raw = tok.decode(ids)
    return Stream(case, ids, steps, text, finish, decoded[0], first_stop(raw, case.stops), raw)


def stop_span_tokens(tok: Tokenizer, s: Stream) -> int:
    """How many of the generated tokens the matched stop string's characters come from: token k
    covers the characters between decode(ids[:k-1]) and decode(ids[:k])."""
    if s.finish != "stop":
        return 0
    stop = next(x for x in s.case.stops if s.raw.startswith(x, s.stop_at))
    begin, end = s.stop_at, s.stop_at + len(stop)
    ends = [len(tok.decode(s.ids[:k])) for k in range(len(s.ids) + 1)]  # ends[0] = 0
    return sum(ends[k - 1] < end and ends[k] > begin for k in range(1, len(ends)))


def byte_values() -> dict[str, int]:
    """GPT-2's byte alphabet, reversed: the visible character a byte-level token uses -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    moved = iter(range(256, 512))
    return {(chr(b) if b in keep else chr(next(moved))): b for b in range(256)}


BYTE_OF = byte_values()


def split_chars(tok: Tokenizer, ids: list[int]) -> int:
    """Characters of the generated text whose UTF-8 bytes arrived in two or more tokens."""
    owner = []  # for every byte of the text, the index of the token it came from
    for k, i in enumerate(ids):
        if i not in tok.special_ids:
            owner += [k] * token_bytes(tok, i)
    raw = bytes(BYTE_OF[c] for i in ids if i not in tok.special_ids for c in tok.backend.id_to_token(i))
    n, pos = 0, 0
    while pos < len(raw):
        lead = raw[pos]
        width = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
        n += len(set(owner[pos : pos + width])) > 1
        pos += width
    return n


def row(tok: Tokenizer, s: Stream) -> dict:
    n = len(s.ids)
    return {
        "case": s.case.name,
        "stop": " ".join(repr(x) for x in s.case.stops) or "-",
        "max_tokens": s.case.max_tokens,
        "tokens": n,
        "finish": s.finish,
        "text_chars": len(s.text),
        "stop_span_tokens": stop_span_tokens(tok, s),
        "max_held_chars": max((len(st.held) for st in s.steps), default=0),
        "silent_steps": sum(st.released == "" for st in s.steps),
        "split_chars": split_chars(tok, s.ids),
        "ends_open": "yes" if s.text.endswith(REPLACEMENT) else "no",
        "window_decodes": s.window_decodes,
        "redecode_decodes": n * (n + 1) // 2,
        "text": s.text.replace("\n", "\\n"),  # one line per row
    }


def streams(model, tok: Tokenizer, cases=CASES) -> list[Stream]:
    return [stream_case(model, tok, c) for c in cases]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, help="one token budget for every case (default: per case)")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    cases = CASES
    if args.max_tokens:
        cases = [Case(c.name, c.prompt, c.stops, args.max_tokens) for c in CASES]
    rows = [row(tok, s) for s in streams(model, tok, cases)]
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    print("streams " + " ".join(f"{r['case']}={r['finish']}:{r['tokens']}" for r in rows))


if __name__ == "__main__":
    main()
