"""A CSV of timings says which CPU measured it.

The course's days were measured on more than one machine kind (AVX2, AVX-512 with VNNI, AMX), and
a time or a rate means little without the machine: every CSV under days/ with a timing column
(milliseconds, microseconds, seconds, tokens or bytes a second) carries a `cpu` column, the
benchmark's CPU line (`nanoserve.bench.cpu_line`). CSVs written before the rule, whose machine no
file records, are listed in NO_CPU_YET until their script runs again; the list only shrinks.
"""

import csv
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMING = re.compile(r"(^|_)(ms|us|seconds|gbs|gflops)(_|$)|(^|_)(tok|gb|gflop|req)_s(_|$)|(^|_)s$")
NOT_TIMING = {"drain_timeout_s"}  # a setting in seconds, not a measurement

NO_CPU_YET = {
    "days/day08/day-08-greedy.csv",
    "days/day08/day-08-steps.csv",
    "days/day11/day-11-cachebench.csv",
    "days/day12/day-12-linear.csv",
    "days/day12/day-12-roofline.csv",
    "days/day15/day-15-window.csv",
    "days/day17/day-17-write.csv",
    "days/day48/day-48-profile.csv",
    "days/day49/day-49-launch.csv",
    "days/day51/day-51-window.csv",
    "days/day53/day-53-addresses.csv",
    "days/day54/day-54-capturebench.csv",
    "days/day55/day-55-pricing.csv",
    "days/day55/day-55-warmbench.csv",
    "days/day56/day-56-serve-warm.csv",
    "days/day56/day-56-serve.csv",
    "days/day58/day-58-attention.csv",
    "days/day58/day-58-profile.csv",
    "days/day58/day-58-step.csv",
    "days/day59/day-59-attention.csv",
    "days/day59/day-59-linears.csv",
    "days/day59/day-59-profile.csv",
    "days/day59/day-59-step.csv",
    "days/day59/day-59-threads.csv",
    "days/day60/day-60-decode.csv",
    "days/day61/day-61-compile.csv",
    "days/day61/day-61-fused.csv",
    "days/day62/day-62-memory.csv",
    "days/day63/day-63-types.csv",
}


def timing_columns(header: list[str]) -> list[str]:
    return [h for h in header if TIMING.search(h) and h not in NOT_TIMING]


def lacking_cpu() -> set[str]:
    out = set()
    for path in sorted(REPO.glob("days/day*/*.csv")):
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if timing_columns(header) and "cpu" not in header:
            out.add(str(path.relative_to(REPO)))
    return out


def test_every_timing_csv_names_its_cpu():
    lacking = lacking_cpu()
    assert not lacking - NO_CPU_YET, f"timing CSVs without a cpu column: {sorted(lacking - NO_CPU_YET)}"
    assert not NO_CPU_YET - lacking, (
        f"these name their CPU now; take them off NO_CPU_YET: {sorted(NO_CPU_YET - lacking)}"
    )


def test_the_rule_reads_timing_columns():
    """The gate on wrongly built inputs: a header with a time and no cpu column is caught."""
    assert timing_columns(["rows", "step_ms", "tok_s", "cpu"]) == ["step_ms", "tok_s"]
    assert timing_columns(["prefill_s", "seconds", "gather_us"]) == ["prefill_s", "seconds", "gather_us"]
    assert timing_columns(["ms_b1", "gb_s_b8", "decode_tok_s"]) == ["ms_b1", "gb_s_b8", "decode_tok_s"]
    assert timing_columns(["rows", "tokens_per_step", "drain_timeout_s", "same_tokens", "msg"]) == []
