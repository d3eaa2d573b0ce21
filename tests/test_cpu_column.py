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
# tables whose seconds are arithmetic, not measured: no machine made them
ARITHMETIC = {"days/day55/day-55-pricing.csv"}  # graphs priced at an assumed 50 ms each

NO_CPU_YET: set[str] = set()  # the 29 CSVs written before the rule were re-run with the column


def timing_columns(header: list[str]) -> list[str]:
    return [h for h in header if TIMING.search(h) and h not in NOT_TIMING]


def lacking_cpu() -> set[str]:
    out = set()
    for path in sorted(REPO.glob("days/day*/*.csv")):
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        rel = str(path.relative_to(REPO))
        if timing_columns(header) and "cpu" not in header and rel not in ARITHMETIC:
            out.add(rel)
    return out


def test_every_timing_csv_names_its_cpu():
    lacking = lacking_cpu()
    assert not lacking - NO_CPU_YET, f"timing CSVs without a cpu column: {sorted(lacking - NO_CPU_YET)}"
    assert not NO_CPU_YET - lacking, (
        f"these name their CPU now; take them off NO_CPU_YET: {sorted(NO_CPU_YET - lacking)}"
    )


def test_the_arithmetic_tables_exist_and_name_no_machine():
    for rel in ARITHMETIC:
        with open(REPO / rel, newline="") as f:
            header = next(csv.reader(f))
        assert timing_columns(header) and "cpu" not in header, rel


def test_the_rule_reads_timing_columns():
    """The gate on wrongly built inputs: a header with a time and no cpu column is caught."""
    assert timing_columns(["rows", "step_ms", "tok_s", "cpu"]) == ["step_ms", "tok_s"]
    assert timing_columns(["prefill_s", "seconds", "gather_us"]) == ["prefill_s", "seconds", "gather_us"]
    assert timing_columns(["ms_b1", "gb_s_b8", "decode_tok_s"]) == ["ms_b1", "gb_s_b8", "decode_tok_s"]
    assert timing_columns(["rows", "tokens_per_step", "drain_timeout_s", "same_tokens", "msg"]) == []


def test_write_csv_names_the_cpu(tmp_path):
    """`write_csv(..., cpu=True)` adds the CPU line as the last column of every row; without it,
    no column is added (the rows as given)."""
    from nanoserve.bench import cpu_line, write_csv

    rows = [{"rows": 1, "step_ms": 2.5}, {"rows": 4, "step_ms": 3.0}]
    with open(write_csv(rows, tmp_path / "t.csv", cpu=True), newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["rows", "step_ms", "cpu"]
    assert {r["cpu"] for r in got} == {cpu_line()} and cpu_line().startswith("cpu: torch capability")
    assert rows[0] == {"rows": 1, "step_ms": 2.5}, "the caller's rows are left as they were"
    with open(write_csv(rows, tmp_path / "u.csv"), newline="") as f:
        assert next(csv.reader(f)) == ["rows", "step_ms"]
