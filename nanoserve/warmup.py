"""Pricing the capture list (day 55): what lazy capture costs a client, what warming costs startup.

A decode graph is recorded once per (rows, width) shape (`buckets.py`). Recorded lazily, the
first step that presents a new shape pays for the recording in front of a waiting client, and a
run presents a new width every `width_multiple` tokens it generates, so the stall recurs for the
life of a request. Recorded at startup, every shape in the list is paid for once, before the
server accepts anything. These functions price both sides in seconds, and read a memory budget
as the widest shape that fits, so the list can be trimmed on both axes:

    lazy_captures(128, 32, prompt_len=16)            -> 5     widths 32, 64, ..., 160
    warmup_seconds(warm_shapes(256, 8192, 128), 0.05) -> 28.8   576 shapes
    width_ceiling(64_000_000, rows=256, heads=32)     -> 1953   tokens of fp32 scores

This module holds the arithmetic: plain functions of numbers, so a notebook can call them with
numbers alone. The warm-up itself (the all-padding batch driven through the capture) needs the
slot table, the persistent inputs and the capture of days 51-54.
"""

from __future__ import annotations

from nanoserve.buckets import bucket_up, row_buckets, width_buckets


def warm_shapes(
    max_batch: int,
    max_model_len: int,
    width_multiple: int,
    max_rows: int | None = None,
    max_width: int | None = None,
) -> list[tuple[int, int]]:
    """Every (rows, width) bucket, trimmed to rows <= max_rows and width <= max_width, biggest
    first: a shared graph pool is sized by its largest member, so recording that one first
    allocates the arena once at its final size."""
    rows = [r for r in row_buckets(max_batch) if max_rows is None or r <= max_rows]
    widths = [w for w in width_buckets(max_model_len, width_multiple) if max_width is None or w <= max_width]
    return sorted(((r, w) for r in rows for w in widths), key=lambda s: (s[0] * s[1], s[0]), reverse=True)


def lazy_captures(
    generated: int, width_multiple: int, prompt_len: int = 1, max_model_len: int | None = None
) -> int:
    """Graphs a lazily capturing engine records for one request at a fixed row count.

    Prefill samples the first token; each of the other `generated - 1` tokens is a decode step
    whose context is prompt_len + 1 ... prompt_len + generated - 1 tokens. Every width bucket
    those contexts touch is one recording.
    """
    if generated < 2:
        return 0
    widths = width_buckets(max_model_len or prompt_len + generated, width_multiple)
    first = bucket_up(prompt_len + 1, widths)
    last = bucket_up(prompt_len + generated - 1, widths)
    return widths.index(last) - widths.index(first) + 1


def stall_seconds(
    generated: int, width_multiple: int, seconds_per_graph: float, prompt_len: int = 1
) -> float:
    """Total time a client waits on recordings over one request of `generated` tokens."""
    return lazy_captures(generated, width_multiple, prompt_len) * seconds_per_graph


def warmup_seconds(shapes: list[tuple[int, int]], seconds_per_graph: float) -> float:
    """Startup time spent recording a capture list."""
    return len(shapes) * seconds_per_graph


def width_ceiling(budget_bytes: int, rows: int, heads: int, bytes_per_score: int = 4) -> int:
    """The widest capture a budget allows: a decode step's attention scores are rows x heads x
    width numbers, and a shared pool is as large as its largest member, so a budget caps the
    width rather than the length of the list."""
    return budget_bytes // (rows * heads * bytes_per_score)
