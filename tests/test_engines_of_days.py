"""Each day runs the engine as it stood that day (COURSE.md, "One engine at a time").

`nanocourse.engine_config(day, **overrides)` builds `EngineConfig` with every named variant
(schedule, attention, linear, decode step, prefix caching, watermark, window blocks) at the value
it had on that day, from one table (`nanocourse.engines.HISTORY`). This file checks the table and
reads every notebook and day script of the course (their code, by its syntax tree): an engine is
configured through `engine_config(M, ...)` with M no later than the file's day and no override
that a later day builds; a bare `EngineConfig(...)` is allowed only from the day on which the
package's defaults are that day's engine. A `BatchedPagedKVCache` built by hand says how it
reads before day 58 (its default is that day's kernel).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nanocourse.engines import BUILT, HISTORY, VARIANTS, built_by, describe, engine_config
from nanoserve.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]
BUILDERS = ("engine_config", "engine_as_of")


def _defaults_day() -> int:
    """The first day whose pinned variants are all `EngineConfig`'s defaults (from then on a bare
    `EngineConfig()` is that day's engine)."""
    default = EngineConfig()
    last = max(c.day for c in HISTORY)
    for day in range(last, 0, -1):
        cfg = engine_config(day)
        if any(getattr(cfg, f) != getattr(default, f) for f in VARIANTS):
            return day + 1
    return 1


def _earliest(field: str):
    """A variant's first value: what the engine had before any day chose (the gather read is the
    only way a pool built by hand before day 18 can be told to read)."""
    return min((c for c in HISTORY if c.field == field), key=lambda c: c.day).value


def _literal(node):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return False, None


def violations(source: str, day: int) -> list[str]:
    """What in `source` (Python, a notebook's or a day script's) configures an engine other than
    as day `day` had it: one sentence each, with its line."""
    out, defaults_day = [], _defaults_day()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name == "BatchedPagedKVCache":  # the pool's read: its default is day 58's kernel
            kws = {kw.arg: kw.value for kw in node.keywords}
            ok, value = _literal(kws["attention"]) if "attention" in kws else (True, "auto")
            first = built_by("attention", value) if ok else None
            if first is not None and first > day and value != _earliest("attention"):
                out.append(f"line {node.lineno}: a pool reading with attention={value!r}, day {first}'s")
            continue
        if name == "EngineConfig" and day < defaults_day:
            out.append(
                f"line {node.lineno}: EngineConfig(...) is the engine of day {defaults_day}; "
                f"use engine_config({day}, ...)"
            )
            continue
        if name in BUILDERS:
            ok, as_of = _literal(node.args[0]) if node.args else (False, None)
            if not ok or not isinstance(as_of, int):
                out.append(f"line {node.lineno}: {name}'s day is not a number written in the call")
            elif as_of > day:
                out.append(f"line {node.lineno}: {name}({as_of}, ...) is a later day's engine")
        elif name != "EngineConfig":
            continue
        for kw in node.keywords:
            if kw.arg is None:
                continue
            ok, value = _literal(kw.value)
            first = built_by(kw.arg, value) if ok else None
            if first is not None and first > day:
                out.append(f"line {node.lineno}: {kw.arg}={value!r} is built on day {first}")
    return out


def _code(path: Path) -> str:
    """A notebook's jupytext source or a day script, its IPython-only lines (magics, `!`) cut."""
    lines = path.read_text().splitlines()
    return "\n".join("" if re.match(r"\s*[%!]", line) else line for line in lines)


def _course_files() -> list[tuple[int, Path]]:
    files = [(int(p.name[3:5]), p) for p in sorted((REPO / "notebooks").glob("day[0-9][0-9]_*.py"))]
    files += [(int(p.parent.name[3:]), p) for p in sorted((REPO / "days").glob("day[0-9][0-9]/*.py"))]
    return files


# Files not yet converted to the engine of their day: each configures a later engine somewhere.
# The list only shrinks: a file listed here that has no violation fails.
# - day 60's benchmark measures the fused step of day 61 and llama.cpp's peers in one table; its
#   fused rows belong to day 61's benchmark, and moving them means re-running the llama.cpp rows.
NOT_YET: set[str] = set()


def test_every_day_configures_the_engine_of_its_day():
    wrong, fixed = [], []
    for day, path in _course_files():
        rel = str(path.relative_to(REPO))
        found = violations(_code(path), day)
        if found and rel not in NOT_YET:
            wrong += [f"{rel}: {v}" for v in found]
        if not found and rel in NOT_YET:
            fixed.append(rel)
    assert not wrong, "\n".join(wrong)
    assert not fixed, f"now the engine of their day, take them off NOT_YET: {fixed}"


def test_a_later_engine_is_caught():
    """The gate on wrongly built inputs: each planted call is refused, its fixed form passes."""
    planted = {
        "EngineConfig(max_batch=4)": 24,  # the package default: native attention, budget, ...
        "engine_config(25, max_batch=4)": 24,  # a later day's engine
        'engine_config(24, attention="native")': 24,  # the C++ kernel of day 58
        "engine_config(51, capture_decode=True, persist_inputs=True, bucket_decode=True)": 51,
        'Engine(m, t, engine_config(60, decode_step="fused"))': 60,  # day 61's fused step
        "engine_config(day, max_batch=4)": 30,  # a day the reader cannot see
        "BatchedPagedKVCache(cfg, 64)": 24,  # reads with the native kernel where it builds
        'BatchedPagedKVCache(cfg, 64, attention="native")': 57,
    }
    for src, day in planted.items():
        assert violations(src, day), src
    for src, day in {
        "engine_config(24, max_batch=4)": 24,
        "engine_config(22, max_batch=4)": 24,
        'engine_config(58, attention="native")': 58,
        "engine_config(54, capture_decode=True, persist_inputs=True, bucket_decode=True)": 54,
        "EngineConfig(max_batch=4)": 68,
        "EngineConfig.watermark": 28,
        'BatchedPagedKVCache(cfg, 64, attention="gather")': 24,
        "BatchedPagedKVCache(cfg, 64)": 58,
    }.items():
        assert not violations(src, day), src


def test_the_table_pins_each_variant_by_day():
    c24, c57, c68 = engine_config(24), engine_config(57), engine_config(68)
    assert (c24.schedule, c24.attention, c24.linear, c24.decode_step) == ("static", "gather", "plain", "ops")
    assert c24.enable_prefix_caching and c24.watermark is None
    assert not engine_config(18).enable_prefix_caching
    assert (c57.schedule, c57.attention, c57.watermark) == ("budget", "gather", 0.05)
    assert engine_config(56).schedule == "prefill-first"
    for f in VARIANTS:  # the last day's engine is the package's default
        assert getattr(c68, f) == getattr(EngineConfig(), f), f
    assert engine_config(30, max_batch=3).max_batch == 3
    with pytest.raises(ValueError, match="built on day 58"):
        engine_config(57, attention="native")
    with pytest.raises(TypeError):
        engine_config(30, no_such_field=1)
    for (field, value), day in BUILT.items():
        with pytest.raises(ValueError, match=f"day {day}"):
            engine_config(day - 1, **{field: value})
        engine_config(day, **{field: value})  # and from that day on it is allowed
    text = describe(10)
    assert "day 18, a later day" in text and "'gather'" in text


def test_every_days_engine_is_a_valid_config():
    for day in range(1, 69):
        engine_config(day).validate()
