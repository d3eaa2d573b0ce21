"""Day 1: what a token costs, text by text.

For a fixed set of short texts (English, French, code, numbers, Chinese, Japanese, emoji, and one
ChatML-rendered chat turn) count characters, UTF-8 bytes and tokens under the model directory's
tokenizer, and how many of the tokens are only part of a character (a lone token that decodes to
U+FFFD). Every number is a count, so the CSV is the same on every machine.

    python days/day01/tokenstats.py                      # the default model -> day-01-tokenstats.csv
    python days/day01/tokenstats.py --model DIR --text poem=poem.txt --out /tmp/stats.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanocourse import write_csv
from nanoserve.tokenizer import REPLACEMENT, Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-01-tokenstats.csv"

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "french": "Le café était fermé, alors nous sommes allés à la bibliothèque près de la gare.",
    "code": "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    "numbers": "In 2024 the index rose 3.14159% to 12,345.67 on 1,000,000 shares.",
    "chinese": "今天天气很好，我们去公园散步吧。",
    "japanese": "東京は日本の首都で、人口は約千四百万人です。",
    "emoji": "Launch day 🚀🎉 thanks team 🙌🏽 from 👨‍👩‍👧‍👦",
}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def text_row(tok: Tokenizer, kind: str, text: str) -> dict:
    ids = tok.encode(text)
    n_bytes = len(text.encode("utf-8"))
    partial = sum(REPLACEMENT in tok.decode([i], skip_special_tokens=False) for i in ids)
    return {
        "kind": kind,
        "chars": len(text),
        "bytes": n_bytes,
        "tokens": len(ids),
        "bytes_per_token": f"{n_bytes / len(ids):.2f}",
        "chars_per_token": f"{len(text) / len(ids):.2f}",
        "partial_tokens": partial,
        "round_trip": "yes" if tok.decode(ids, skip_special_tokens=False) == text else "no",
    }


def tokenstats_rows(tok: Tokenizer, texts: dict[str, str] | None = None) -> list[dict]:
    """One row per text; the last row is the default system prompt plus one user turn in ChatML."""
    texts = dict(TEXTS if texts is None else texts)
    rows = [text_row(tok, kind, text) for kind, text in texts.items()]
    rows.append(text_row(tok, "chat", tok.apply_chat_template(CHAT)))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--text", action="append", default=[], metavar="KIND=PATH", help="add a file as a row")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    tok = Tokenizer.from_dir(resolve_model_dir(args.model))
    texts = dict(TEXTS)
    for spec in args.text:
        kind, _, path = spec.partition("=")
        texts[kind] = Path(path).read_text()
    rows = tokenstats_rows(tok, texts)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
