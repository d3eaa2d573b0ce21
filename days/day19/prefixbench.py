"""Day 19: prefix sharing on a real multi-turn chat, SmolLM2-135M-Instruct through the engine.

A chat client sends the whole conversation every turn, so turn t's prompt begins with turn
t - 1's prompt and the reply the model gave to it. The engine's prefix cache names every full
block of 16 tokens by a chained hash (`nanoserve.blocks.block_hashes`) and, when a prompt
arrives, reuses the leading blocks whose names it holds instead of computing them again.

For each conversation and turn the script records the prompt's length in tokens and in full
blocks, how many of those blocks the allocator found cached (`num_cached_tokens` of the
sequence's block table, read right after the step that admitted it), and how many prompt
tokens the model then had to compute, with the cache on and with it off
(`enable_prefix_caching=False`, the engine as it was before today). Replies are greedy, so both
runs must give the same tokens; the script asserts it. Conversation B starts over with another
question after conversation A: only the system prompt the chat template puts first is common.

Counts are facts; the two time columns (the first step of each turn: prefill plus the first
token, the fastest over `--repeats` runs of the whole chat, the variants taking turns) are
this machine's, shared with other jobs.

    python days/day19/prefixbench.py                       # -> day-19-chat.csv
    python days/day19/prefixbench.py --turns 3 --max-tokens 16 --out /tmp/chat.csv
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nanocourse import engine_config, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_CHAT = HERE / "day-19-chat.csv"
BLOCK_SIZE = 16
MAX_TOKENS = 16
CONVERSATIONS = {
    "A": [
        "I want to learn to cook. Where should I start?",
        "What should I cook first?",
        "How long does it take?",
        "Any tips for chopping onions?",
        "Thanks! What should I cook next week?",
    ],
    "B": [
        "What is a good name for a cat?",
        "Why that name?",
        "And one for a dog?",
    ],
}


def chat_engine(model, tok, prefix_caching: bool = True) -> Engine:
    """A small engine for one conversation at a time: 1,024 positions of context, 64 MiB of K/V."""
    config = engine_config(
        19,
        max_model_len=1024,
        kv_budget="64MiB",
        max_batch=4,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=prefix_caching,
    )
    return Engine(model, tok, config)


def run_turn(engine: Engine, prompt_ids: list[int], max_tokens: int) -> dict:
    """One request to the end: its reply tokens and text, the prompt tokens it found cached
    (read after its first step, before finishing empties the table) and that first step's time."""
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens))
    seq = engine.requests[rid].seq
    tokens, text, cached, first_s = [], "", None, None
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        if first_s is None:
            first_s, cached = time.perf_counter() - t0, seq.block_table.num_cached_tokens
        for o in outs:
            tokens += o.new_token_ids
            text += o.text_delta
    return {"tokens": tokens, "text": text, "cached": cached, "first_s": first_s}


def chat(engine: Engine, tok, conversations=CONVERSATIONS, turns: int | None = None, max_tokens=MAX_TOKENS):
    """Every conversation, one turn after another, on one engine (so B may find A's blocks).
    Returns one dict per turn, with the prompt and the reply."""
    out = []
    for name, users in conversations.items():
        messages = []
        for t, user in enumerate(users[:turns], start=1):
            messages.append({"role": "user", "content": user})
            prompt = tok.encode_chat(messages)
            got = run_turn(engine, prompt, max_tokens)
            messages.append({"role": "assistant", "content": got["text"]})
            out.append({"conversation": name, "turn": t, "user": user, "prompt": prompt, **got})
    return out


def chat_rows(on: list[list[dict]], off: list[list[dict]], block_size: int = BLOCK_SIZE) -> list[dict]:
    """The table: one row per turn, the cache on against the cache off. `on` and `off` are
    repeated runs of the same chat; every run must give the same prompts and replies, and each
    time column keeps a turn's fastest first step over the runs (a shared machine only ever
    slows a step down)."""
    rows = []
    for turns in zip(*on, *off):
        a, b = turns[0], turns[len(on)]
        for other in turns[1:]:
            if other["prompt"] != a["prompt"] or other["tokens"] != a["tokens"]:
                raise AssertionError(
                    f"conversation {a['conversation']} turn {a['turn']}: the prefix cache changed the tokens"
                )
        n = len(a["prompt"])
        rows.append(
            {
                "conversation": a["conversation"],
                "turn": a["turn"],
                "prompt_tokens": n,
                "prompt_blocks": n // block_size,
                "cached_blocks": a["cached"] // block_size,
                "cached_tokens": a["cached"],
                "computed_on": n - a["cached"],
                "computed_off": n - b["cached"],
                "reply_tokens": len(a["tokens"]),
                "hit_rate": round(a["cached"] / n, 3),
                "first_step_ms_on": round(1e3 * min(t["first_s"] for t in turns[: len(on)]), 1),
                "first_step_ms_off": round(1e3 * min(t["first_s"] for t in turns[len(on) :]), 1),
                "cpu": cpu_line(),
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--turns", type=int, default=None, help="turns per conversation (default: all)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="reply budget per turn")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the whole chat per variant")
    p.add_argument("--out", default=str(CSV_CHAT))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    on, off = [], []
    for _ in range(args.repeats):  # the two variants take turns, a fresh engine each run
        for caching, runs in ((True, on), (False, off)):
            engine = chat_engine(model, tok, caching)
            runs.append(chat(engine, tok, turns=args.turns, max_tokens=args.max_tokens))
    for r in on[0]:
        print(f"{r['conversation']}{r['turn']} {r['user']!r} -> {r['text']!r}")
    rows = chat_rows(on, off)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    total = sum(r["prompt_tokens"] for r in rows)
    print(
        f"prefix chat: {sum(r['cached_tokens'] for r in rows)} of {total} prompt tokens cached, "
        f"{sum(r['computed_on'] for r in rows)} computed against {sum(r['computed_off'] for r in rows)}"
    )


if __name__ == "__main__":
    main()
