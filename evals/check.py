"""lm-evaluation-harness against nanoserve and against transformers, on the same weights.

    make lmeval            # installs the `eval` extra (lm_eval 0.4.13) and runs this
    .venv/bin/python evals/check.py [--port 8123] [--model DIR]

Two small local tasks (JSONL under evals/data; nothing is downloaded): a multiple-choice one,
scored by log-likelihood the way most academic benchmarks are (lm-eval sends context +
choice as token ids with echo, logprobs 1, max_tokens 1), and a generation one (greedy
sentence completion, up to a period, comma or newline). Each runs twice through lm-eval:
with its `local-completions` backend against `nanoserve serve` (a real server in a
subprocess, on its default engine: buckets, persistent inputs, captured graphs, a warm list)
and with its own `hf` backend on the converted model directory in fp32. The check fails
unless both give the same accuracy, the same chosen answer for every question, every
choice's log-likelihood within the tolerance of tests/test_scores.py (2e-3 per token, times
the continuation's tokens), and the same generated text. It prints a table and writes
evals/lmeval.csv.

The server's default path serves the GGUF with int8 activations (README, "The default path"):
other numbers than the fp32 model's, so there the check asks instead that each score be within
the reference's standard error (lm-eval's, or sqrt(p (1 - p) / (n - 1)) where it gives "N/A"),
and reports how many answers agree. That gate is what made int8 the default; `--serve-args
"--quant-activations fp32"` serves the same file with fp32 activations and gets the strict check.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOL_PER_TOKEN = 2e-3  # tests/test_scores.py: twice the logit tolerance of tests/test_model.py

MC_TASK = """\
task: nanoserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_TASK = """\
task: nanoserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [".", ",", "\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$", "^the "]
"""


def wait_ready(url: str, proc, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"nanoserve serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("nanoserve serve was not ready in time")


def evaluate(model: str, model_args: dict, tasks_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["nanoserve_mc", "nanoserve_gen"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
    )


def per_question(result: dict, task: str) -> list[dict]:
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--model", default=None, help="a converted model directory (default: SmolLM2)")
    ap.add_argument("--out", default=str(HERE / "lmeval.csv"))
    ap.add_argument(
        "--serve-args",
        default="",
        help="more options for `nanoserve serve`, e.g. '--quant-activations fp32' (default: none: the "
        "server's own defaults)",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from nanoserve.bench import cpu_line
    from nanoserve.weights import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    print(cpu_line())
    tasks_dir = Path(tempfile.mkdtemp(prefix="nanoserve-tasks-"))
    (tasks_dir / "mc.yaml").write_text(MC_TASK.format(data=HERE / "data"))
    (tasks_dir / "gen.yaml").write_text(GEN_TASK.format(data=HERE / "data"))

    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--port", str(args.port), "--threads", "2"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += shlex.split(args.serve_args)
    server = subprocess.Popen(cmd)
    try:
        wait_ready(url, server)
        import httpx

        paths = httpx.get(url + "/health", timeout=10).json().get("paths", {})
        # int8 activations are other numbers than the fp32 model's: held to its scores within
        # their standard errors, not to its every log-likelihood (the gate `make lmeval` sets for
        # the default path, README "The default path")
        int8 = paths.get("activations") == "int8"
        print(f"server: {' '.join(cmd[3:])}\npaths: {paths}")
        t0 = time.perf_counter()
        ours = evaluate(
            "local-completions",
            {
                "base_url": url + "/v1/completions",
                "model": model_dir.name,
                "tokenizer": str(model_dir),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "max_length": 2048,
            },
            tasks_dir,
        )
        t_ours = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    t0 = time.perf_counter()
    ref = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, tasks_dir)
    t_ref = time.perf_counter() - t0

    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)

    def continuation_tokens(context: str, continuation: str) -> int:
        """As lm-eval splits a pair: encode the whole, drop the context's tokens."""
        return len(tok.encode(context + continuation)) - len(tok.encode(context))

    failures, rows = [], []
    worst = 0.0
    for a, b in zip(per_question(ours, "nanoserve_mc"), per_question(ref, "nanoserve_mc")):
        got = [float(r[0][0]) for r in a["resps"]]  # one (loglikelihood, is_greedy) per choice
        want = [float(r[0][0]) for r in b["resps"]]
        pick_a, pick_b = (
            max(range(len(got)), key=got.__getitem__),
            max(range(len(want)), key=want.__getitem__),
        )
        err = max(abs(x - y) for x, y in zip(got, want))
        worst = max(worst, err)
        for (context, continuation), x, y in zip(a["arguments"], got, want):
            # a log-likelihood sums one score per continuation token, so the tolerance adds up too
            if not int8 and abs(x - y) > TOL_PER_TOKEN * max(1, continuation_tokens(context, continuation)):
                failures.append(
                    f"mc {a['doc_id']}: {continuation!r} scores {x:.6f} here, {y:.6f} in transformers"
                )
        if pick_a != pick_b and not int8:
            failures.append(f"mc {a['doc_id']}: nanoserve picks {pick_a}, transformers {pick_b}")
        rows.append(["mc", a["doc_id"], pick_a, pick_b, int(a["acc"]), int(b["acc"]), f"{err:.2e}", "", ""])
    for a, b in zip(per_question(ours, "nanoserve_gen"), per_question(ref, "nanoserve_gen")):
        text_a, text_b = a["filtered_resps"][0], b["filtered_resps"][0]
        if text_a != text_b and not int8:
            failures.append(f"gen {a['doc_id']}: {text_a!r} vs {text_b!r}")
        em_a, em_b = int(a["exact_match"]), int(b["exact_match"])
        rows.append(["gen", a["doc_id"], "", "", em_a, em_b, "", text_a, text_b])

    acc = {
        name: (ours["results"][task][metric], ref["results"][task][metric])
        for name, task, metric in (
            ("mc acc", "nanoserve_mc", "acc,none"),
            ("mc acc_norm", "nanoserve_mc", "acc_norm,none"),
            ("gen exact_match", "nanoserve_gen", "exact_match,none"),
        )
    }

    def standard_error(task: str, metric: str) -> float:
        """lm-eval's standard error of the reference's score; where it gives none ("N/A"), the
        same formula over the per-question 0/1 scores: sqrt(p (1 - p) / (n - 1))."""
        v = ref["results"][task].get(metric.replace(",", "_stderr,"))
        if isinstance(v, (int, float)):
            return float(v)
        p, n = ref["results"][task][metric], len(per_question(ref, task))
        return math.sqrt(p * (1 - p) / max(1, n - 1))

    stderr = {
        name: standard_error(task, metric)
        for name, task, metric in (
            ("mc acc", "nanoserve_mc", "acc,none"),
            ("mc acc_norm", "nanoserve_mc", "acc_norm,none"),
            ("gen exact_match", "nanoserve_gen", "exact_match,none"),
        )
    }
    for name, (x, y) in acc.items():
        if int8 and abs(x - y) > stderr[name]:
            failures.append(
                f"{name}: nanoserve {x} vs transformers {y}, more than its standard error {stderr[name]:.3f}"
            )
        elif not int8 and x != y:
            failures.append(f"{name}: nanoserve {x} vs transformers {y}")

    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "task",
                "doc",
                "nanoserve_pick",
                "hf_pick",
                "nanoserve_score",
                "hf_score",
                "max_ll_diff",
                "nanoserve_text",
                "hf_text",
            ]
        )
        w.writerows(rows)
    print(f"\n{'metric':<18}{'nanoserve':>11}{'transformers':>14}{'stderr':>9}")
    for name, (x, y) in acc.items():
        print(f"{name:<18}{x:>11.3f}{y:>14.3f}{stderr[name]:>9.3f}")
    mc_rows = [r for r in rows if r[0] == "mc"]
    same = sum(r[2] == r[3] for r in mc_rows)
    print(f"chosen answers equal: {same}/{len(mc_rows)}; worst choice log-likelihood difference {worst:.2e}")
    gen_rows = [r for r in rows if r[0] == "gen"]
    print(f"generated answers equal: {sum(r[7] == r[8] for r in gen_rows)}/{len(gen_rows)}")
    print(f"wall time: local-completions {t_ours:.1f} s, hf {t_ref:.1f} s; rows in {args.out}")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    if int8:
        print("OK: with int8 activations lm-eval's scores through nanoserve are within their standard errors")
    else:
        print("OK: lm-eval gives the same answers through nanoserve as through transformers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
