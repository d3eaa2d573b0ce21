"""The engine as it stood on a day of the course, from one table.

The package keeps every earlier way of doing a thing as a named variant of `EngineConfig` (the
prefill-first schedule, the gather read of the KV pool, the model's own linears, ...), so a day
can run the engine of its time and the day that replaces a way can measure the new one against
it. `HISTORY` lists, for each variant, the day that chose each value; `engine_config(day)` is
the config with every variant at the value it had on that day, and keyword overrides on top:

    config = engine_config(24, max_batch=4, kv_budget="16MiB")   # gather, plain linears, static
    engine = engine_as_of(24, model, tok, max_batch=4)            # the same, built

An override may only choose a value some day up to `day` built (day 24 cannot ask for the
native kernel of day 58): the course never runs a piece before the day that builds it without
saying so, and where it must (a day before 34 stepping an `Engine`) it says which day builds it.

Fields the table leaves alone (`max_batch`, `kv_budget`, `max_num_batched_tokens`, ...) are
sizes, not ways, and take `EngineConfig`'s defaults. The capture fields of days 52-54
(`bucket_decode`, `persist_inputs`, `capture_decode`) stay opt-in: a day that measures them turns
them on, and from day 61 the default path (the fused step) runs eagerly. The model is whatever
the day loads (`Engine(model, ...)` takes it as given): the fp32 conversion until day 60, which
reads the GGUF's own blocks; `weights` and `quant_activations` (where `build_engine` loads the
model from a config) keep `EngineConfig`'s defaults and may be chosen from day 60 on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from nanoserve.config import EngineConfig


@dataclass(frozen=True)
class Choice:
    day: int  # the day from which `field` has `value`
    field: str
    value: object
    why: str  # what the day built, in a few words


HISTORY: tuple[Choice, ...] = (
    # one sequence's prompt in one forward; prefix sharing arrives with hashed blocks
    Choice(1, "enable_prefix_caching", False, "every prompt computed in full"),
    Choice(19, "enable_prefix_caching", True, "prefix sharing: hashed full blocks, reference counts"),
    # the KV pool's read: a padded copy per row (day 18) until the C++ kernel reads in place
    Choice(18, "attention", "gather", "paged attention by gathering each row and masking"),
    Choice(58, "attention", "auto", "attention in place: the native kernel where it builds"),
    # who runs in a step
    Choice(22, "schedule", "static", "static batching: a new batch only when the last is done"),
    Choice(26, "schedule", "prefill-first", "the scheduler: a step is all prefill or all decode"),
    Choice(57, "schedule", "budget", "mixed steps: decode rows and prompt chunks share a budget"),
    # admission's reserve
    Choice(1, "watermark", None, "admit into the last free blocks"),
    Choice(28, "watermark", 0.05, "admission keeps a block a row and 5% of the pool free"),
    # the linears and the decode step
    Choice(3, "linear", "plain", "torch's matmul on the weights as loaded"),
    Choice(59, "linear", "auto", "weights packed once for oneDNN where it can pack them"),
    Choice(1, "decode_step", "ops", "a decode step is the model's torch ops"),
    Choice(61, "decode_step", "auto", "one native call a step for quantized weights"),
    # sliding-window layers
    Choice(1, "window_blocks", False, "every layer holds every position"),
    Choice(65, "window_blocks", True, "sliding layers keep only the blocks a window can read"),
)

# values no day pins as the engine's default but some day builds, and so may choose as an override
# from that day on (the opt-in ways of days 52-54 and 68 among them)
BUILT: dict[tuple[str, object], int] = {
    ("scheduling_policy", "priority"): 31,  # fairness: who goes first, who gives way
    ("attention", "native"): 58,
    ("linear", "packed"): 59,
    ("decode_step", "fused"): 61,
    # what the matrices hold where build_engine loads the model (a day's own model otherwise)
    ("weights", "q4_1"): 60,
    ("weights", "q8_0"): 60,
    ("quant_activations", "int8"): 60,
    ("bucket_decode", True): 52,
    ("persist_inputs", True): 53,
    ("capture_decode", True): 54,
    ("speculative", "ngram"): 68,
}

VARIANTS = tuple(dict.fromkeys(c.field for c in HISTORY))
_FIELDS = {f.name for f in fields(EngineConfig)}
assert set(VARIANTS) <= _FIELDS, set(VARIANTS) - _FIELDS


def _pinned(day: int) -> dict[str, Choice]:
    """For each variant, the latest choice made on or before `day` (a variant no day up to then
    chose keeps the value of its first day: the engine had no other way yet)."""
    out: dict[str, Choice] = {}
    for c in sorted(HISTORY, key=lambda c: c.day):
        if c.day <= day or c.field not in out:
            out[c.field] = c
    return out


def built_by(field: str, value) -> int | None:
    """The first day whose engine had `field` at `value`; None if the table never chose it."""
    days = [c.day for c in HISTORY if c.field == field and c.value == value]
    if (field, value) in BUILT:
        days.append(BUILT[field, value])
    return min(days) if days else None


def engine_config(day: int, **overrides) -> EngineConfig:
    """`EngineConfig` as of `day`: every variant pinned as `HISTORY` has it, then `overrides`.
    An override of a variant to a value first chosen after `day` is refused."""
    if not 1 <= day:
        raise ValueError(f"day must be at least 1, got {day}")
    for name, value in overrides.items():
        if name not in _FIELDS:
            raise TypeError(f"EngineConfig has no field {name!r}")
        first = built_by(name, value)
        if first is not None and first > day:
            raise ValueError(f"{name}={value!r} is built on day {first}, after day {day}")
    values = {name: c.value for name, c in _pinned(day).items()}
    return EngineConfig(**{**values, **overrides})


def engine_as_of(day: int, model, tokenizer, **overrides):
    """An `Engine` over `model` with `engine_config(day, **overrides)`."""
    from nanoserve.engine import Engine

    return Engine(model, tokenizer, engine_config(day, **overrides))


def describe(day: int) -> str:
    """One line a variant: its value on `day` and the day that chose it."""
    lines = [f"the engine as of day {day}:"]
    for name, c in _pinned(day).items():
        since = f"day {c.day}" if c.day <= day else f"day {c.day}, a later day"
        lines.append(f"  {name:<22} {c.value!r:<16} {since}: {c.why}")
    return "\n".join(lines)
