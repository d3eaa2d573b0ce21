"""`python -m nanoserve.bench grammar` (issue 32), small: the default model, 4 rows, a few tokens.

What it prints and writes, and that a grammar on half the rows leaves the other rows' greedy
tokens as they were; no timing is judged here (speed lives in the benchmark, not in tests).
"""

import csv

from nanoserve.bench import main


def test_grammar_bench_prints_every_figure_and_leaves_unconstrained_rows_alone(smollm_dir, tmp_path, capsys):
    path = tmp_path / "grammar.csv"
    argv = ["grammar", "--model", str(smollm_dir), "--weights", "dtype", "--rows", "4", "--tokens", "6"]
    argv += ["--repeats", "1", "--mask-steps", "4", "--max-model-len", "1024", "--csv", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cpu: torch capability")
    assert out[1].startswith(f"model {smollm_dir.name}, 4 rows, 6 tokens a row") and "load average" in out[1]
    text = "\n".join(out)
    for label in (
        "fill, 4 rows (llguidance)",
        "apply_mask, 4 rows, native",
        "apply_mask, 4 rows, torch fallback",
        "advance, 4 matchers",
        "sampler, 4 greedy rows, no masks",
        "decode step, 0/4 grammar rows (engine)",
        "decode step, 2/4 grammar rows (engine)",
        "ratio B/A",
    ):
        assert label in text, label
    assert "unconstrained rows' tokens in B equal A's: yes" in text
    assert "apply native and torch wrote the same logits: yes" in text
    assert out[-1].startswith("RESULT grammar rows=4 ") and out[-1].endswith("unconstrained_equal=True")

    rows = list(csv.DictReader(path.open()))
    step = {r["figure"]: r for r in rows if r["section"] == "step"}
    assert set(step) == {
        "fill",
        "apply_native",
        "apply_torch",
        "advance",
        "mask",
        "sampler",
        "sampler_masked",
        "step_A",
        "step_B",
        "step_C",
    }
    for r in step.values():
        assert float(r["median_us"]) <= float(r["p90_us"])
        assert abs(float(r["per_row_median_us"]) - float(r["median_us"]) / 4) <= 0.1
    assert int(step["fill"]["samples"]) == 4
    runs = {r["figure"]: r for r in rows if r["section"] == "throughput"}
    assert {k: int(r["constrained"]) for k, r in runs.items()} == {"run_A": 0, "run_B": 2, "run_C": 4}
    assert all(int(r["tokens"]) == 4 * 6 for r in runs.values())
    # each schema asks for more items than there are tokens, so no grammar ends early
    assert all(int(r["completed_early"]) == 0 for r in runs.values())
    assert {r["figure"] for r in rows if r["section"] == "summary"} == {
        "ratio_B_A",
        "ratio_B_A_decode",
        "ratio_B_A_paired",
        "row_cost_half_us",
        "row_cost_all_us",
    }
