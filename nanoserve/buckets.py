"""Decode shapes from a closed set (day 52): row buckets and width buckets.

A captured decode step (day 54) replays one fixed shape, so a batch must be presented in one
of a small, closed set of shapes rather than at its own (rows, width). Rows round up to a power
of two no larger than `max_batch`; the attention width (the longest context in the batch)
rounds up to a multiple of `width_multiple` no larger than `max_model_len`:

    row_buckets(256)                 -> (1, 2, 4, 8, 16, 32, 64, 128, 256)
    width_buckets(8192, 128)         -> (128, 256, ..., 8192)            64 widths
    bucket_shape(3, 200, 256, 8192, 128) -> (4, 256)

The shape set is the product: 9 x 64 = 576 shapes at serving size, which is what the warm-up
(`warmup.py`) has to price. This module holds the arithmetic only; how a padded row is made
harmless (context_lens 0, K/V written to the sink slot) lives with the plan that pads it.
"""

from __future__ import annotations

from nanoserve.errors import GateError


def row_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to max_batch, plus max_batch itself when it is not one."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    rows, r = [], 1
    while r < max_batch:
        rows.append(r)
        r *= 2
    rows.append(max_batch)
    return tuple(rows)


def width_buckets(max_model_len: int, width_multiple: int) -> tuple[int, ...]:
    """Multiples of width_multiple up to max_model_len (the last one may be max_model_len)."""
    if width_multiple < 1 or max_model_len < 1:
        raise ValueError(
            f"width_multiple and max_model_len must be positive, got {width_multiple}, {max_model_len}"
        )
    widths = list(range(width_multiple, max_model_len + 1, width_multiple))
    if not widths or widths[-1] != max_model_len:
        widths.append(max_model_len)
    return tuple(widths)


def bucket_up(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value."""
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} is larger than the largest bucket {buckets[-1]}")


def bucket_shape(
    rows: int, width: int, max_batch: int, max_model_len: int, width_multiple: int
) -> tuple[int, int]:
    """The (rows, width) a decode batch is padded up to."""
    return bucket_up(rows, row_buckets(max_batch)), bucket_up(
        width, width_buckets(max_model_len, width_multiple)
    )


def check_pad_inert(plan, sink_slot: int) -> None:
    """Padded rows touch nothing: every row past the plan's real rows has context_lens 0 and
    writes to the sink, and no real row writes to the sink. Passes vacuously on no rows."""
    n = len(plan.rows)
    ctx, writes = plan.context_lens.tolist(), plan.write_slots.tolist()
    for r in range(n, len(ctx)):
        if ctx[r] != 0 or writes[r] != sink_slot:
            raise GateError(
                f"padded row {r} is not inert: context_lens {ctx[r]} (want 0), write_slots {writes[r]} "
                f"(want the sink {sink_slot})"
            )
    for r in range(n):
        if writes[r] == sink_slot:
            raise GateError(f"real row {r} writes its K/V to the sink slot {sink_slot}; it would be lost")
