"""Day 68's table: n-gram speculative decoding against decoding one token a step, on the default
model (SmolLM2-135M-Instruct from its GGUF's Q4_1 blocks, int8 activations, the fused step: what
`build_engine` makes for it on a CPU), greedy.

Two workloads of four chat prompts each: "copy" asks the model to write out a function with one
name changed, repeat a paragraph with one word changed, repeat a list, or return a JSON record with
one field changed, so the answer copies its prompt (the lookup's good case); "free" asks plain
questions, whose answers copy nothing but what they repeat of themselves. Each workload runs at
one row (its prompts one after another, each alone in the engine) and at four rows (all four in
one `generate`), through two engines that differ only in `speculative`: None, and "ngram" with K 3
(`num_speculative_tokens`) and n-grams of 2 to 4.

Every (workload, rows, engine) runs three times: once untimed (it also puts the prompts in the
prefix cache, so the timed runs prefill the same few tokens whichever engine runs them), then
twice timed; `seconds` is the better of the two, prefill and decode together. The speculation
counters (`Engine.spec_stats`) are a run's own (the difference across it) and must be the same in
all three runs; `tokens_equal` says whether the ngram engine's tokens equal the plain engine's.

Two CSVs, written next to this file:

* `day-68-spec.csv`: per workload, rows and engine: tokens generated, seconds, tok_s,
  ratio_to_off (the plain engine's seconds over this one's, for the same tokens), the
  verifications (rows that carried a draft), draft and accepted tokens, the acceptance rate and
  the mean accepted length (tokens a verifying row produced, the model's own one included),
  tokens_equal, the CPU (`cpu_line`).
* `day-68-costs.csv`: `bench.verify_costs` for 1 and 4 rows with 0, 1 and 3 draft tokens each:
  one step's median time, and its ratio to the step without drafts.

The notebook calls `make_engine` and `run` on its own engines.

    python days/day68/specbench.py                  # both CSVs, here (about two minutes on 2 cores)
    python days/day68/specbench.py --quick          # one prompt of each workload at one row, printed
    python days/day68/specbench.py --out /tmp/d68   # elsewhere
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path

from nanocourse import write_csv
from nanoserve.bench import cpu_line, verify_costs
from nanoserve.config import EngineConfig
from nanoserve.engine import build_engine
from nanoserve.sampling import SamplingParams
from nanoserve.speculative import SpecStats

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 128
K = 3

CODE = """def mean_and_spread(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    mean = total / count
    spread = 0
    for value in values:
        spread = spread + (value - mean) ** 2
    return mean, (spread / count) ** 0.5
"""
PARAGRAPH = (
    "The cat sat by the window every morning. When the sun came up, the cat stretched, yawned and "
    "watched the birds in the garden. At noon the cat walked along the fence, stopped at the gate and "
    "looked at the dogs across the road. In the evening the cat came home, ate its dinner and slept on "
    "the old blue chair by the fire until the morning came again."
)
RECORD = (
    '{"name": "Ada Lovelace", "born": 1815, "city": "London", "languages": ["English", "French"], '
    '"known_for": "the first published program", "age": 36}'
)
WORKLOADS = {
    "copy": [
        f"Here is some Python code:\n\n```python\n{CODE}```\n\nRewrite it in full with one change: rename "
        "`total` to `acc` everywhere. Reply with the code only.",
        f"Repeat this paragraph exactly, with 'cat' changed to 'dog':\n\n{PARAGRAPH}",
        "Repeat this list exactly, one item a line: apples, pears, plums, cherries, apricots, figs, dates, "
        "limes, lemons, oranges, melons, grapes, kiwis, mangoes, peaches.",
        f"Return this JSON exactly, with the age changed to 41: {RECORD}",
    ],
    "free": [
        "Give three tips for staying focused while studying.",
        "Explain in a few sentences why the sky is blue.",
        "Name the planets of the solar system and say one fact about each.",
        "How do I make a cup of tea?",
    ],
}
COUNTERS = ("verifications", "draft_tokens", "accepted_tokens", "emitted_tokens")


def make_engine(speculative: str | None, activations: str = "int8", max_batch: int = 4, k: int = K):
    """The day's engine: the default model from its GGUF's own Q4_1 blocks, `activations` int8
    (as `build_engine` serves it) or fp32, the fused decode step; `speculative` None or "ngram"
    with up to `k` draft tokens a row. The pool and paths lines it prints are returned, not shown."""
    config = EngineConfig(
        weights="gguf",
        quant_activations=activations,
        max_batch=max_batch,
        max_model_len=1024,
        speculative=speculative,
        num_speculative_tokens=k,
    )
    with redirect_stderr(StringIO()) as said:
        engine = build_engine(config)
    return engine, said.getvalue()


def run(engine, prompts: list[str], rows: int, max_tokens: int = MAX_TOKENS) -> dict:
    """Every prompt answered greedily, `rows` at a time: {"tokens": each answer's token ids,
    "seconds": wall time, "stats": the speculation counters this run added}."""
    before = {k: getattr(engine.spec_stats, k) for k in COUNTERS}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    t0 = time.perf_counter()
    done = []
    for i in range(0, len(messages), rows):
        done += engine.generate(messages[i : i + rows], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    stats = {k: getattr(engine.spec_stats, k) - before[k] for k in COUNTERS}
    return {"tokens": [c.token_ids for c in done], "seconds": seconds, "stats": stats}


def measure(engines: dict, workload: str, rows: int, prompts=None, repeats: int = 2) -> list[dict]:
    """One CSV row per engine for a workload at `rows`: an untimed run, then the best of `repeats`."""
    prompts = prompts or WORKLOADS[workload]
    runs = {}
    for spec, engine in engines.items():
        first = run(engine, prompts, rows)
        timed = [run(engine, prompts, rows) for _ in range(repeats)]
        for r in timed:  # greedy: the same tokens and the same drafts every time
            assert r["tokens"] == first["tokens"] and r["stats"] == first["stats"], (workload, rows, spec)
        runs[spec] = first | {"seconds": min(r["seconds"] for r in timed)}
    off = runs[None]
    out = []
    for spec, r in runs.items():
        s = SpecStats(**r["stats"])  # the run's own counters, for the package's two rates
        tokens = sum(len(t) for t in r["tokens"])
        out.append(
            {
                "workload": workload,
                "rows": rows,
                "spec": spec or "off",
                "tokens": tokens,
                "seconds": round(r["seconds"], 2),
                "tok_s": round(tokens / r["seconds"], 1),
                "ratio_to_off": round(off["seconds"] / r["seconds"], 2),
                "verifications": s.verifications,
                "draft_tokens": s.draft_tokens,
                "accepted_tokens": s.accepted_tokens,
                "acceptance_rate": round(s.acceptance_rate, 3),
                "mean_accepted_length": round(s.mean_accepted_length, 2),
                "tokens_equal": r["tokens"] == off["tokens"],
                "cpu": cpu_line(),
            }
        )
    return out


def costs(repeats: int = 15) -> list[dict]:
    """`bench.verify_costs` on the default model: 1 and 4 rows, 0, 1 and 3 draft tokens a row."""
    with redirect_stderr(StringIO()):
        got = verify_costs(None, rows=(1, 4), drafts=(0, 1, K), repeats=repeats)
    out = []
    for c in got:
        base = next(x for x in got if x["rows"] == c["rows"] and x["draft_tokens"] == 0)
        out.append(c | {"ratio_to_no_draft": round(c["step_ms"] / base["step_ms"], 2), "cpu": cpu_line()})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one prompt of each workload at one row, printed")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs a cell (the best is kept)")
    ap.add_argument("--out", default=None, help="folder for the CSVs (default: next to this file)")
    args = ap.parse_args(argv)
    print(cpu_line())
    engines = {}
    for spec in (None, "ngram"):
        engines[spec], said = make_engine(spec)
    print(said.strip().splitlines()[-1])  # the ngram engine's paths line
    rows = []
    for workload, prompts in WORKLOADS.items():
        for n in (1,) if args.quick else (1, 4):
            got = measure(engines, workload, n, prompts[:1] if args.quick else prompts, args.repeats)
            rows += got
            for r in got:
                print("  ", {k: v for k, v in r.items() if k != "cpu"}, flush=True)
    if args.quick:
        return
    cost_rows = costs()
    for c in cost_rows:
        print("  ", {k: v for k, v in c.items() if k != "cpu"})
    out = Path(args.out) if args.out else HERE
    write_csv(rows, out / "day-68-spec.csv")
    write_csv(cost_rows, out / "day-68-costs.csv")
    print(f"wrote {out / 'day-68-spec.csv'} and {out / 'day-68-costs.csv'}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
