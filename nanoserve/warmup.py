"""The warm list (day 55): record every decode graph before serving, and price the choice.

Each (rows, width) decode shape (`buckets.py`) needs one recording. Left to the first request
that reaches it, that recording is paid by a client mid-stream, and since a request's context
crosses into a new width bucket every `width_multiple` tokens, one long answer meets several.
Done at startup, the whole list is paid once, while /health still says 503. The functions here
put both costs in seconds and turn a free-memory figure into the widest shape that fits:

    lazy_captures(128, 32, prompt_len=16)            -> 5     widths 32, 64, ..., 160
    warmup_seconds(warm_shapes(256, 8192, 128), 0.05) -> 28.8   576 shapes
    width_ceiling(64_000_000, rows=256, heads=32)     -> 1953   tokens of fp32 scores

They take plain numbers, so a notebook can call them without an engine. The recording side is
`warmup_plan` and `warm_decode`. A warm plan names no sequence: each of its rows is padding,
whose write lands in the sink slot and whose context length is 0, yet its slot window is a
slice of the engine's own `SlotTable` and its per-row tensors sit in the engine's own
`PersistentInputs`, because a graph keeps the addresses it was recorded with. `warm_decode`
records one graph per shape from such plans, largest shape first, and returns a
`WarmupReport`. What each graph froze is an empty tuple of rows, so it carries no request's
state into later replays; the gates below check that and the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanoserve.buckets import bucket_up, row_buckets, width_buckets
from nanoserve.errors import GateError
from nanoserve.plan import StepPlan


def biggest_first(shapes) -> list[tuple[int, int]]:
    """Shapes by rows x width, largest first (ties: more rows first)."""
    return sorted(shapes, key=lambda s: (s[0] * s[1], s[0]), reverse=True)


def warm_shapes(
    max_batch: int,
    max_model_len: int,
    width_multiple: int,
    max_rows: int | None = None,
    max_width: int | None = None,
) -> list[tuple[int, int]]:
    """Every (rows, width) bucket, trimmed to rows <= max_rows and width <= max_width, biggest
    first. On CUDA all graphs draw from one memory pool; when the largest is recorded first,
    every later, smaller recording fits in memory the pool already holds."""
    rows = [r for r in row_buckets(max_batch) if max_rows is None or r <= max_rows]
    widths = [w for w in width_buckets(max_model_len, width_multiple) if max_width is None or w <= max_width]
    return biggest_first((r, w) for r in rows for w in widths)


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


# --- the warm-up itself --------------------------------------------------------------------------


@dataclass
class WarmupReport:
    """What a warm-up recorded and what it cost. `bytes` is memory the list holds: on CUDA the
    growth of the shared graph pool, measured; on CPU the graphs' output buffers (a HostGraph
    keeps nothing else). `max_rows`, `max_width` and `width_ceiling` say how the list was trimmed
    (`build_engine` fills them in; None when a caller chose the shapes itself)."""

    shapes: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    bytes: int = 0
    max_rows: int | None = None
    max_width: int | None = None
    width_ceiling: int | None = None

    @property
    def graphs(self) -> int:
        return len(self.shapes)

    def describe(self) -> str:
        return f"warm list: {self.graphs} graphs in {self.seconds:.2f} s, {self.bytes / 1e6:.1f} MB"

    def as_dict(self) -> dict:
        return {
            "graphs": self.graphs,
            "seconds": round(self.seconds, 3),
            "bytes": self.bytes,
            "max_rows": self.max_rows,
            "max_width": self.max_width,
            "width_ceiling": self.width_ceiling,
            "shapes": [list(s) for s in self.shapes],
        }


def warmup_plan(shape: tuple[int, int], slot_table, inputs) -> StepPlan:
    """A decode plan of `shape` over no sequences: all rows padded, so it writes only the sink
    and attends to nothing, through the same window and buffers a real step uses."""
    rows, width = shape
    input_ids, positions, write_slots, context_lens, logits_at = inputs.write([], [], [], [], rows)
    return StepPlan(
        input_ids=input_ids,
        positions=positions,
        write_slots=write_slots,
        context_lens=context_lens,
        slot_window=slot_table.read((), width, pad_rows=rows),
        logits_at=logits_at,
        rows=(),
        is_decode=True,
    )


def warmup_batch(shape: tuple[int, int], slot_table, inputs, cache):
    """A warm plan and the cache bound to it: the step a graph is recorded from. Its made-up
    tokens are the buffers' padding (token 0 at position 0); its rows are the empty tuple."""
    plan = warmup_plan(shape, slot_table, inputs)
    return plan, cache.view(plan)


def warm_budget_bytes(device="cpu", reserve_bytes: int = 0) -> int:
    """Memory free for the graphs' pool, probed after the weights and the KV pool are resident:
    free device memory on CUDA, available host memory elsewhere, less a reserve."""
    import os

    import torch

    if str(device).startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(0, free - reserve_bytes)


def warm_decode(runner, shapes: list[tuple[int, int]]) -> WarmupReport:
    """Record a graph for every shape not yet recorded, from warm plans, biggest first."""
    import torch

    report = WarmupReport()
    cuda = runner.model.device.type == "cuda"
    reserved = torch.cuda.memory_reserved(runner.model.device) if cuda else 0
    t0 = time.perf_counter()
    for shape in biggest_first(shapes):
        if shape in runner.graphs:
            continue
        plan = warmup_plan(shape, runner.slot_table, runner.inputs)
        check_warm_rows_empty(plan)
        check_warm_writes_sink(plan, runner.slot_table.sink_slot)
        graph = runner.record(plan)
        report.shapes.append(shape)
        if not cuda and isinstance(graph.output, torch.Tensor):
            report.bytes += graph.output.numel() * graph.output.element_size()
    if cuda:
        torch.cuda.synchronize(runner.model.device)
        report.bytes = torch.cuda.memory_reserved(runner.model.device) - reserved
    report.seconds = time.perf_counter() - t0
    return report


def check_warm_rows_empty(plan: StepPlan) -> None:
    """A warm plan addresses no sequence."""
    if plan.rows:
        raise GateError(f"a warm plan must have no rows; this one has {len(plan.rows)}")


def check_warm_writes_sink(plan: StepPlan, sink_slot: int) -> None:
    """Every row of a warm plan writes to the sink and attends to nothing."""
    bad = [
        r
        for r, (w, c) in enumerate(zip(plan.write_slots.tolist(), plan.context_lens.tolist()))
        if w != sink_slot or c != 0
    ]
    if bad:
        raise GateError(f"warm rows {bad} write outside the sink or attend to something")


def check_warm_graphs_unbound(graphs: dict) -> None:
    """Every graph in the list froze the empty row tuple: it came from the warm-up, not from a
    step that slipped past it."""
    bound = [shape for shape, g in graphs.items() if g.args and g.args[0].rows]
    if bound:
        raise GateError(f"graphs {bound} were recorded over real rows, not by the warm-up")


def check_no_cold_captures(cold_captures: int) -> None:
    """No step recorded a graph in front of a client (a warmed boot records them all first; a
    lazy one records each on the first step of its shape, and fails this)."""
    if cold_captures:
        raise GateError(f"{cold_captures} graphs were recorded mid-run, in front of a request")


def check_table_stable(slot_table, address: int) -> None:
    """The slot table is where the graphs were recorded against: `SlotTable.to` reallocates, and
    every window a graph holds would then read the old storage."""
    if slot_table.address != address:
        raise GateError(
            f"the slot table moved from {address:#x} to {slot_table.address:#x} after recording; "
            "every captured window reads the old storage"
        )


def check_warm_touches_nothing(before: list, after: list, sink_slot: int) -> None:
    """A warm-up changes no pool entry but the sink: `before`/`after` are per-layer K (or V)
    pools, (num_slots + 1, kv_heads, head_dim), copied around the warm-up."""
    for layer, (a, b) in enumerate(zip(before, after)):
        changed = (a[:sink_slot] != b[:sink_slot]).flatten(1).any(1).nonzero().flatten().tolist()
        if changed:
            raise GateError(f"the warm-up wrote to real slots {changed[:5]} of layer {layer}")


def check_all_warm(shapes: list[tuple[int, int]], graphs: dict) -> None:
    """Every shape in the warm list has its graph."""
    missing = [s for s in shapes if s not in graphs]
    if missing:
        raise GateError(f"{len(missing)} shapes of the warm list have no graph, e.g. {missing[:3]}")


def check_warm_budget(shapes: list[tuple[int, int]], budget_bytes: int, heads: int, bytes_per_score: int = 4):
    """No shape in the list needs more score memory than the budget (rows x heads x width)."""
    over = [(r, w) for r, w in shapes if r * heads * w * bytes_per_score > budget_bytes]
    if over:
        raise GateError(f"{len(over)} warm shapes exceed the {budget_bytes:,}-byte budget, e.g. {over[:3]}")
