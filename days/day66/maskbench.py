"""Day 66's table: what a token mask costs a step, against what sampling the step costs.

A row with a grammar (structured output, `nanoserve/grammar.py`) pays two things a step that a
plain row does not: llguidance fills its mask (`Grammars.fill`, one int32 bitmask row: bit
t % 32 of word t // 32 set where token t may come next), and the sampler writes -inf into every
refused logit (`apply_mask`, the native kernel `mask.cpp` where it builds, torch ops otherwise).
This script times both for 16 rows on SmolLM2's vocabulary of 49,152, next to `sample_rows` for
16 greedy rows, the whole of what a plain step spends choosing its tokens.

One CSV, written next to this file, `day-66-cost.csv`: one row per (op, variant), with the rows,
the vocabulary, how many tokens each row's mask allows, the median time over `--repeats` and the
CPU line (`nanoserve.bench.cpu_line`). The masks are filled in three states:

* `forced`: the tiny schema of the day at its start, where the grammar forces `{"ok": ` and
  llguidance allows exactly one token, the tokenizer's own first token of the forced text,
* `a choice`: the same schema after `{"ok":`, where a space and `true` or `false` may follow,
* `inside a string`: a one-string schema after `{"name": "`, where almost any token may follow.

A matcher keeps the mask of the state it is in, so asking the same matchers again answers from
that cache; every timed `fill` gets fresh matchers (copies of the compiled grammar, advanced to
the state), as an engine's rows, which move every step, do. The `asked again` row is the cache.

The notebook calls `setup`, `STATES`, `matchers_at` and `cost_rows` (at a few repeats).

    python days/day66/maskbench.py                  # writes day-66-cost.csv here (200 repeats)
    python days/day66/maskbench.py --repeats 20     # quicker, noisier
    python days/day66/maskbench.py --out /tmp/d66   # elsewhere
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import lru_cache
from pathlib import Path
from unittest import mock

import torch

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.grammar import Grammars, Guided, apply_mask
from nanoserve.sampling import SamplingParams, sample_rows
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

HERE = Path(__file__).resolve().parent
SEED = 66
VOCAB = 49152  # SmolLM2's vocabulary, the width of its logits
ROWS = 16
REPEATS = 200

# the day's tiny schema: two required properties, three and two values, nothing else
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
# every answer it allows, written as the package writes JSON (grammar.JSON_LAYOUT: ", " and ": ")
ANSWERS = [json.dumps({"ok": ok, "n": n}) for ok in (True, False) for n in (1, 2, 3)]
# a schema whose string lets almost any token through, for a mask that is nearly full
STRING_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}},
    "required": ["name"],
    "additionalProperties": False,
}
# state -> (schema, the text already written)
STATES = {
    "forced": (SCHEMA, ""),
    "a choice": (SCHEMA, '{"ok":'),
    "inside a string": (STRING_SCHEMA, '{"name": "'),
}


@lru_cache(maxsize=1)
def setup() -> tuple[Tokenizer, Grammars]:
    """SmolLM2's tokenizer and the engine's grammar holder for it (llguidance's tokenizer is
    built on the first compile: under a second)."""
    tok = Tokenizer.from_dir(fetch_default_model())
    return tok, Grammars(tok, VOCAB, tok.eos_ids)


def matchers_at(grammars: Grammars, tok: Tokenizer, state: str, rows: int = ROWS) -> list:
    """`rows` fresh matchers of the state's schema, each fed the state's text as the tokenizer
    spells it."""
    schema, text = STATES[state]
    guided = Guided.json_schema(schema)
    ids = tok.encode(text, add_bos=False) if text else []
    out = []
    for _ in range(rows):
        m = grammars.matcher(guided)
        for t in ids:
            refused = grammars.advance(m, t)
            assert refused is None, refused
        out.append(m)
    return out


def allowed_per_row(bitmask: torch.Tensor) -> list[int]:
    """How many bits each row of an int32 bitmask sets."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (rows, words, 32)
    return bits.sum((1, 2)).tolist()


def median_us(run, repeats: int, prepare=None) -> float:
    """The median wall time of `run(prepare())` in µs, `prepare` untimed, after one untimed call."""
    prepare = prepare or (lambda: None)
    run(prepare())
    times = []
    for _ in range(repeats):
        arg = prepare()
        t0 = time.perf_counter_ns()
        run(arg)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def _row(op, variant, rows, allowed, us, repeats, cpu):
    return {
        "op": op,
        "variant": variant,
        "rows": rows,
        "vocab": VOCAB,
        "allowed": allowed,
        "repeats": repeats,
        "median_us": round(us, 1),
        "per_row_us": round(us / rows, 2),
        "cpu": cpu,
    }


def cost_rows(rows: int = ROWS, repeats: int = REPEATS, seed: int = SEED) -> list[dict]:
    """One row of day-66-cost.csv per (op, variant): fill in each state (fresh matchers, and the
    same matchers asked again), apply_mask natively and by torch ops, and sample_rows for greedy
    rows without and with masks."""
    tok, grammars = setup()
    cpu = cpu_line()
    out = []
    masks = {}
    for state in STATES:
        filled = grammars.fill(matchers_at(grammars, tok, state, rows))
        counts = allowed_per_row(filled)
        assert len(set(counts)) == 1  # every row in the same state
        masks[state] = filled
        us = median_us(grammars.fill, repeats, lambda s=state: matchers_at(grammars, tok, s, rows))
        out.append(_row("fill", state, rows, counts[0], us, repeats, cpu))
    same = matchers_at(grammars, tok, "inside a string", rows)
    us = median_us(lambda _: grammars.fill(same), repeats)
    out.append(_row("fill", "inside a string, asked again", rows, out[-1]["allowed"], us, repeats, cpu))

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g)  # (rows, V) fp32, as the engine samples from
    bitmask = masks["inside a string"]
    index = list(range(rows))
    allowed = allowed_per_row(bitmask)[0]
    from nanoserve.kernels import native

    if native() is not None and hasattr(native(), "apply_token_bitmask"):
        us = median_us(lambda x: apply_mask(x, index, bitmask), repeats, logits.clone)
        out.append(_row("apply_mask", "native kernel", rows, allowed, us, repeats, cpu))
    with mock.patch("nanoserve.kernels.native", lambda: None):  # the fallback: bits unpacked by torch
        us = median_us(lambda x: apply_mask(x, index, bitmask), repeats, logits.clone)
    out.append(_row("apply_mask", "torch ops", rows, allowed, us, repeats, cpu))

    params, gens = [SamplingParams()] * rows, [None] * rows  # greedy
    us = median_us(lambda _: sample_rows(logits, params, gens), repeats)
    out.append(_row("sample_rows", "greedy, no masks", rows, VOCAB, us, repeats, cpu))
    us = median_us(lambda _: sample_rows(logits, params, gens, masks=(index, bitmask)), repeats)
    out.append(_row("sample_rows", "greedy, every row masked", rows, allowed, us, repeats, cpu))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", default=str(HERE), help="folder for the CSV")
    args = ap.parse_args(argv)
    print(cpu_line())
    t0 = time.perf_counter()
    rows = cost_rows(args.rows, args.repeats, args.seed)
    path = write_csv(rows, Path(args.out) / "day-66-cost.csv")
    print(path.name)
    for r in rows:
        print(f"   {r['op']:<12} {r['variant']:<30} {r['allowed']:>6} allowed  {r['median_us']:>9.1f} µs")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
