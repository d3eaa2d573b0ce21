"""Day 55's warmbench: the cold column is lazy_captures, warming leaves nothing cold, and the
committed CSVs are what the script computes (the seed's arithmetic, to the digit)."""

import csv
import importlib.util
from pathlib import Path

DAY55 = Path(__file__).resolve().parents[1] / "days" / "day55"


def load_warmbench():
    spec = importlib.util.spec_from_file_location("warmbench", DAY55 / "warmbench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(name):
    with open(DAY55 / name) as f:
        return list(csv.DictReader(f))


def test_cold_column_is_lazy_captures_and_warming_leaves_none():
    rows = load_warmbench().cold_table()
    assert [r["cold_lazy"] for r in rows] == [r["predicted"] for r in rows] == [1, 2, 3, 5]
    assert all(r["cold_warmed"] == 0 for r in rows)
    assert [r["warm_graphs"] for r in rows] == [4, 4, 6, 10]  # the seed's warm list column
    committed = read("day-55-warmbench.csv")
    for got, want in zip(rows, committed):
        for col in ("generated", "cold_lazy", "predicted", "cold_warmed", "warm_graphs"):
            assert str(got[col]) == want[col]


def test_pricing_and_budget_csvs_are_the_seed_arithmetic():
    wb = load_warmbench()
    assert [{k: str(v) for k, v in r.items()} for r in wb.pricing_table()] == read("day-55-pricing.csv")
    assert [{k: str(v) for k, v in r.items()} for r in wb.budget_table()] == read("day-55-budget.csv")
    pricing = read("day-55-pricing.csv")
    assert [r["lazy_graphs"] for r in pricing] == ["1", "4", "16", "64"]
    assert [r["stall_s"] for r in pricing] == ["0.05", "0.20", "0.80", "3.20"]
    assert {(r["warm_full_s"], r["warm_rows8_s"], r["warm_rows8_ctx2048_s"]) for r in pricing} == {
        ("28.80", "12.80", "3.20")
    }
    budget = read("day-55-budget.csv")
    assert [(r["widest_capture"], r["shapes_that_fit"]) for r in budget] == [
        ("1953", "135"),
        ("8178", "567"),
        ("8192", "576"),
    ]
