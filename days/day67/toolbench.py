"""Day 67's tables: what Qwen2.5-Coder-0.5B-Instruct does with tools when it is left free
(tool_choice "auto") and when a grammar makes it call one ("required").

Every prompt is one user message, rendered with the same three functions (`TOOLS`) through the
model's chat template, exactly as the server renders a chat request with `tools`; the answers
are greedy, at most `MAX_TOKENS` tokens, all prompts of a mode in one batch through the engine.
Under "auto" nothing constrains the model; under "required" the prompt is the same and
`tool_grammar(TOOLS, "required")` becomes a token mask a step (day 66's machinery). Each answer
is then read as the server reads it (`parse_tool_calls`), and a call counts as valid when its
arguments validate against its function's JSON schema (jsonschema). Before the modes are timed,
one request puts the tools block, which every prompt shares, in the prefix cache (`warm`).

Two CSVs, written next to this file:

* `day-67-answers.csv`: one row per prompt: the function it calls for ("-" for the prompts that
  need none) and, for each mode, what the answer holds (a `<tool_call>` block, the call written
  as JSON in prose or in a ```json fence, or text), the function it names, whether the
  arguments validate, the tokens generated, and the finish_reason the server would send.
* `day-67-summary.csv`: per mode: of the prompts that call for a tool, the answers with a valid
  call and those with the right function, and the calls written in prose instead; of the
  others, the answers in plain text; tokens; the mode's wall time (a measurement, which the
  journal's tables do not compare); the CPU (`cpu_line`).

The notebook calls `make_engine` and `bench` on the prompts of `SMALL`.

    python days/day67/toolbench.py                   # all 15 prompts, writes the two CSVs here
    python days/day67/toolbench.py --small           # the notebook's 3, printed (written with --out)
    python days/day67/toolbench.py --out /tmp/d67    # elsewhere
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path

import jsonschema

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.config import EngineConfig
from nanoserve.engine import build_engine
from nanoserve.grammar import Guided
from nanoserve.sampling import SamplingParams
from nanoserve.tools import BLOCK, parse_tool_calls, tool_grammar

HERE = Path(__file__).resolve().parent
MODEL = "qwen2.5-coder-0.5b-instruct"
MAX_TOKENS = 60
MODES = ("auto", "required")


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI tool object."""
    parameters = {"type": "object", "properties": properties, "required": required}
    body = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": body}


TOOLS = [
    function(
        "get_weather",
        "Get the current weather in a city.",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    function("get_time", "Get the current local time in a city.", {"city": {"type": "string"}}, ["city"]),
    function(
        "convert_currency",
        "Convert an amount of money from one currency to another (ISO 4217 codes such as USD).",
        {
            "amount": {"type": "number"},
            "from_currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to_currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        },
        ["amount", "from_currency", "to_currency"],
    ),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# (the user's message, the function it calls for; None: none)
PROMPTS = [
    ("What's the weather in Paris?", "get_weather"),
    ("What time is it in Tokyo?", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("Is it raining in London right now?", "get_weather"),
    ("What's the local time in Sydney?", "get_time"),
    ("How many Japanese yen is 50 British pounds?", "convert_currency"),
    ("How hot is it in Cairo today, in fahrenheit?", "get_weather"),
    ("Is it morning or evening in New York right now?", "get_time"),
    ("I have 20 EUR. How much is that in Swiss francs?", "convert_currency"),
    ("Should I take an umbrella in Oslo today?", "get_weather"),
    ("Tell me the current time in Berlin.", "get_time"),
    ("What is 250 Canadian dollars in US dollars?", "convert_currency"),
    ("Write a haiku about the sea.", None),
    ("What is 17 times 3?", None),
    ("In one sentence, what is a Python list comprehension?", None),
]
SMALL = (1, 7, 13)  # the notebook's: a call, a wrong pick under "required", no call wanted


def make_engine(max_batch: int = 8):
    """The day's engine: Qwen2.5-Coder-0.5B-Instruct from its GGUF's own blocks with int8
    activations (day 60), the fused decode step (day 61); the pool and paths lines it prints
    are kept (returned), not shown."""
    config = EngineConfig(
        model=MODEL, weights="gguf", quant_activations="int8", max_batch=max_batch, max_model_len=4096
    )
    with redirect_stderr(StringIO()) as said:
        engine = build_engine(config)
    return engine, said.getvalue()


def messages(prompt: str, history=()) -> list[dict]:
    """The request's conversation: `history` (earlier turns, none by default), then the prompt."""
    return [*history, {"role": "user", "content": prompt}]


def params(mode: str, tools=TOOLS) -> SamplingParams:
    """Greedy, at most MAX_TOKENS; under "required" (or a named function) the call grammar."""
    grammar = tool_grammar(tools, mode)
    guided = Guided("grammar", grammar, "tool_choice") if grammar else None
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, guided=guided)


def warm(engine, tools=TOOLS) -> None:
    """One request of one token, so that the template's tools block (the same in every prompt)
    is in the prefix cache before a mode is timed: both modes then compute only each prompt's
    own tail, and neither pays for the block the other cached."""
    ids = engine.encode_prompt(messages("Hi"), tools)
    engine.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)


def run_mode(engine, mode: str, prompts=PROMPTS, tools=TOOLS, history=()):
    """Every prompt's answer under `mode`, all in one batch: (completions, seconds). The
    prompts are rendered with the tools as the server renders them (`encode_prompt`)."""
    ids = [engine.encode_prompt(messages(p, history), tools) for p, _ in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(ids, params(mode, tools), use_tqdm=False)
    return outs, time.perf_counter() - t0


FENCE = re.compile(r"```(?:json)?\s*(\{.*?\})\s*```", re.DOTALL)


def prose_call(text: str) -> dict | None:
    """A call written as JSON outside any <tool_call> block, {"name": ..., "arguments": ...}
    in a ```json fence or as the whole answer: what a lenient parser (vLLM's and llama.cpp's are
    not) might still read as a call. None if the answer holds no such object."""
    outside = BLOCK.sub("", text)
    for candidate in [m.group(1) for m in FENCE.finditer(outside)] + [outside.strip()]:
        try:
            data = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("name"), str) and "arguments" in data:
            return data
    return None


def valid(name: str, arguments: dict) -> bool:
    """Whether a call names one of the tools and its arguments validate against its schema."""
    if name not in SCHEMAS:
        return False
    try:
        jsonschema.validate(arguments, SCHEMAS[name])
    except jsonschema.ValidationError:
        return False
    return True


def answer_row(prompt: str, wanted: str | None, out) -> dict:
    """One answer as the server would return it: what it holds ("tool_call block", "JSON in
    prose" or "text"), how many `tool_calls` the server would send, the function called (by
    the first block, or by the JSON in prose; "-" for none), whether its arguments validate
    ("-" for none), the tokens generated and the finish_reason ("tool_calls" when the server
    sends calls and the model stopped, as responses.py says)."""
    _, calls = parse_tool_calls(out.text)
    finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
    called, ok, kind = "-", "-", "text"
    if calls:
        kind, called = "tool_call block", calls[0]["function"]["name"]
        ok = valid(called, json.loads(calls[0]["function"]["arguments"]))
    elif (found := prose_call(out.text)) is not None:
        kind, called = "JSON in prose", found["name"]
        ok = isinstance(found["arguments"], dict) and valid(called, found["arguments"])
    return {
        "prompt": prompt,
        "wanted": wanted or "-",
        "answer": kind,
        "tool_calls": len(calls),
        "called": called,
        "valid": ok,
        "tokens": len(out.token_ids),
        "finish": finish,
    }


def summary_row(mode: str, rows: list[dict], seconds: float) -> dict:
    """One row of day-67-summary.csv from a mode's `answer_row`s: of the prompts that call for
    a tool, the answers the server returns a valid call for, with the right function; the calls
    written in prose instead, and how many of those name the right function; of the other
    prompts, the answers in plain text; tokens; seconds."""
    calling = [r for r in rows if r["wanted"] != "-"]
    other = [r for r in rows if r["wanted"] == "-"]
    blocks = [r for r in calling if r["answer"] == "tool_call block" and r["valid"] is True]
    prose = [r for r in calling if r["answer"] == "JSON in prose"]
    return {
        "mode": mode,
        "prompts_calling": len(calling),
        "valid_calls": len(blocks),
        "right_function": sum(r["called"] == r["wanted"] for r in blocks),
        "calls_in_prose": len(prose),
        "prose_right_function": sum(r["called"] == r["wanted"] for r in prose),
        "prompts_other": len(other),
        "other_in_text": sum(r["answer"] == "text" for r in other),
        "tokens": sum(r["tokens"] for r in rows),
        "seconds": f"{seconds:.1f}",
        "cpu": cpu_line(),
    }


PER_MODE = ("answer", "called", "valid", "tokens", "finish")  # the answer columns, once per mode


def bench(engine, prompts=PROMPTS, modes=MODES, history=()):
    """(day-67-answers.csv's rows: one per prompt, each mode's answer side by side; the summary
    rows, one per mode; each mode's `answer_row`s by mode). One batch a mode, after `warm`."""
    warm(engine)
    by_mode, summary = {}, []
    for mode in modes:
        outs, seconds = run_mode(engine, mode, prompts, history=history)
        by_mode[mode] = [answer_row(p, w, o) for (p, w), o in zip(prompts, outs)]
        summary.append(summary_row(mode, by_mode[mode], seconds))
    answers = [
        {"prompt": p, "wanted": w or "-"}
        | {f"{mode}_{k}": by_mode[mode][i][k] for mode in modes for k in PER_MODE}
        for i, (p, w) in enumerate(prompts)
    ]
    return answers, summary, by_mode


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="only the notebook's prompts (SMALL)")
    ap.add_argument("--out", default=None, help="folder for the CSVs (default: next to this file)")
    args = ap.parse_args(argv)
    print(cpu_line())
    engine, said = make_engine()
    print(said.strip().splitlines()[-1])  # the paths line
    answers, summary, _ = bench(engine, [PROMPTS[i] for i in SMALL] if args.small else PROMPTS)
    out = Path(args.out) if args.out else None if args.small else HERE  # --small keeps the full CSVs
    for name, rows in (("day-67-answers.csv", answers), ("day-67-summary.csv", summary)):
        if out is not None:
            write_csv(rows, out / name)
        print(name)
        for row in rows:
            print("  ", {k: v for k, v in row.items() if k != "cpu"})
    sys.stdout.flush()


if __name__ == "__main__":
    main()
