"""Day 69: what the sampling penalties do to a greedy answer that loops, and what they cost.

SmolLM2-135M-Instruct (the default model, from its GGUF's own Q4_1 blocks, fp32 activations)
answers one story prompt greedily under no penalty and under each of the three penalties at a
few strengths, all in one batch. For each answer: its length, its distinct tokens, and its
repeated 3-grams (3-grams that occurred earlier in the same answer). Greedy tokens are
deterministic, so `day-69-repetition.csv` is a fact of the model and the engine.

`day-69-cost.csv` times a decode step of the engine with every row penalized against the same
step with none, at 1 and 8 rows, the two alternating, best of `--repeats`. A penalized step
also hands the sampler each row's token ids and counts them (`sampling.token_counts`); the
step's model work is the same. `sampler_ms` times `sample_rows` alone on the step's logits
shape, with the same histories, to show where the difference lies.

    python days/day69/penaltybench.py                 # both tables (well under a minute, 2 quiet cores)
    python days/day69/penaltybench.py --repeats 20    # steadier timings
"""

from __future__ import annotations

import argparse
import time
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path

import torch

from nanocourse import engine_config, write_csv
from nanoserve.engine import build_engine
from nanoserve.sampling import SamplingParams, sample_rows

HERE = Path(__file__).resolve().parent
PROMPT = "Write a story about a cat."
MAX_TOKENS = 96
# (penalty, strength): the field of SamplingParams and its value; ("none", 0) is the plain answer
SETTINGS = [
    ("none", 0.0),
    ("repetition_penalty", 1.1),
    ("repetition_penalty", 1.3),
    ("frequency_penalty", 0.2),
    ("frequency_penalty", 0.5),
    ("presence_penalty", 0.5),
    ("presence_penalty", 1.0),
]
COST_PARAMS = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)


def make_engine(max_batch: int = 8):
    """The engine as of day 69 over the default model: GGUF blocks, fp32 activations (so a
    near-tie in a greedy token does not hang on int8 rounding), up to `max_batch` rows."""
    config = engine_config(
        69, weights="gguf", quant_activations="fp32", max_batch=max_batch, max_model_len=1024
    )
    with redirect_stderr(StringIO()):
        return build_engine(config)


def params_of(penalty: str, strength: float, **extra) -> SamplingParams:
    kw = {} if penalty == "none" else {penalty: strength}
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **kw, **extra)


def repeated_ngrams(ids: list[int], n: int = 3) -> int:
    """How many of the answer's n-grams occurred earlier in it: [1, 2, 3, 1, 2, 3] has 4
    3-grams, (1, 2, 3) twice, so 1."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) - len(set(grams))


def longest_run(ids: list[int]) -> int:
    """The longest stretch of the answer that copies an earlier stretch of it, in tokens: the
    largest n with a repeated n-gram (0 when no token repeats)."""
    n = 0
    while repeated_ngrams(ids, n + 1) > 0 and n + 1 <= len(ids):
        n += 1
    return n


def answers(engine, settings=SETTINGS, prompt: str = PROMPT, **extra) -> list:
    """Every setting's greedy answer to `prompt`, one batch: a Completion each, in order."""
    messages = [{"role": "user", "content": prompt}]
    params = [params_of(p, s, **extra) for p, s in settings]
    return engine.generate([messages] * len(settings), params, use_tqdm=False)


def repetition_rows(engine) -> list[dict]:
    done = answers(engine)
    plain = done[0].token_ids
    rows = []
    for (penalty, strength), c in zip(SETTINGS, done):
        ids = c.token_ids
        first = next((i for i, (a, b) in enumerate(zip(ids, plain)) if a != b), None)
        rows.append(
            dict(
                penalty=penalty,
                strength=strength,
                tokens=len(ids),
                distinct_tokens=len(set(ids)),
                repeated_3grams=repeated_ngrams(ids),
                longest_repeat=longest_run(ids),
                departs_at=-1 if first is None else first,
                finish=c.finish_reason,
            )
        )
    return rows


def _decode_step_ms(engine, rows: int, penalized: bool, steps: int) -> float:
    """Best ms of `steps` decode steps of `rows` rows, after their prefill and one warm step."""
    kw = COST_PARAMS if penalized else {}
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True, **kw)
    ids = [engine.add_request([{"role": "user", "content": PROMPT}], params) for _ in range(rows)]
    while any(engine.requests[r].seq.needs_prefill for r in ids):  # the prompts in
        engine.step()
    engine.step()
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - t0)
    for r in ids:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    return best * 1e3


def _sampler_ms(rows: int, vocab: int, penalized: bool, repeats: int) -> float:
    """Best ms of `sample_rows` alone on (rows, vocab) logits, greedy, with histories of 140
    tokens (about a prompt and half an answer)."""
    g = torch.Generator().manual_seed(69)
    logits = torch.randn(rows, vocab, generator=g)
    hist = [(torch.randint(vocab, (140,), generator=g).tolist(), 40) for _ in range(rows)]
    kw = COST_PARAMS if penalized else {}
    params = [SamplingParams(temperature=0.0, **kw) for _ in range(rows)]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if penalized:
            sample_rows(logits, params, [None] * rows, hist)
        else:
            sample_rows(logits, params, [None] * rows)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def cost_rows(engine, repeats: int = 15, steps: int = 8) -> list[dict]:
    """ms of a decode step and of the sampler alone, penalties off and on, at 1 and 8 rows; each
    the best over `repeats` rounds in which off and on alternate."""
    vocab = engine.model.cfg.vocab_size
    out = []
    for rows in (1, 8):
        best = {False: float("inf"), True: float("inf")}
        sampler = {False: float("inf"), True: float("inf")}
        for _ in range(repeats):
            for penalized in (False, True):
                best[penalized] = min(best[penalized], _decode_step_ms(engine, rows, penalized, steps))
                sampler[penalized] = min(sampler[penalized], _sampler_ms(rows, vocab, penalized, steps))
        for penalized in (False, True):
            out.append(
                dict(
                    rows=rows,
                    penalties="on" if penalized else "off",
                    step_ms=round(best[penalized], 2),
                    sampler_ms=round(sampler[penalized], 3),
                    ratio_to_off=round(best[penalized] / best[False], 2),
                )
            )
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15, help="rounds of off and on, each timed")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed in a round")
    ap.add_argument("--no-cost", action="store_true", help="the repetition table only")
    args = ap.parse_args(argv)
    engine = make_engine()
    rows = repetition_rows(engine)
    write_csv(rows, HERE / "day-69-repetition.csv")
    for r in rows:
        print(r)
    if not args.no_cost:
        costs = cost_rows(engine, args.repeats, args.steps)
        write_csv(costs, HERE / "day-69-cost.csv", cpu=True)
        for c in costs:
            print(c)


if __name__ == "__main__":
    main()
