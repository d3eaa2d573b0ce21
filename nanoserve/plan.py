"""What one engine step computes, and where its K/V goes (day 25).

A `StepPlan` is the whole addressing of a step as tensors, built from the scheduler's choice of
sequences and their block tables:

    input_ids     (N,)   the step's new tokens, every row's packed end to end
    positions     (N,)   each token's position in its sequence
    write_slots   (N,)   the slot each new token's K/V is written to
    context_lens  (B,)   tokens each row attends over once this step's are written
    slot_window   (B, W) row r's slots for positions 0..W-1 (W >= every context_len)
    logits_at     (B,)   index into N of each row's last token: the ones we sample from
    rows                 the sequences, in row order

`plan_prefill` packs chunks of prompts (a chunk is positions [start, end) of one sequence; a
prefix already cached or computed is skipped by starting past it). `plan_decode` gives every
row one token, its newest. Both build the window from block ids rather than from slot lists:
(B, blocks) ids -> (B, blocks * block_size) slots in one broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoserve.buckets import bucket_up
from nanoserve.errors import GateError


@dataclass
class StepPlan:
    input_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    context_lens: torch.Tensor
    slot_window: torch.Tensor
    logits_at: torch.Tensor
    rows: tuple = ()
    is_decode: bool = False
    row_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, ctx) in N

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    chunks = ()  # not a field: a decode plan has no chunks (PrefillPlan's are its rows)
    verify = False  # not a field: only a VerifyPlan verifies drafts


@dataclass
class VerifyPlan(StepPlan):
    """plan_verify's: decode rows, a row's draft as more one-token rows (speculative decoding).
    A subclass, not a field, so a decode plan's fields (what a decode graph binds, day 50) are
    unchanged."""

    verify = True


@dataclass
class PrefillPlan(StepPlan):
    """A prefill step's plan, or a mixed step's (phase 6): decode rows first as one-token chunks.
    Its extra fields are not a decode plan's, so what a decode graph binds (day 50) is unchanged."""

    chunks: list = field(default_factory=list)  # the (seq, start, end) of each row
    num_decode: int = 0  # leading rows that are one-token decode rows
    decode_width: int = 0  # the longest context among them


def slot_window(block_lists: list[list[int]], block_size: int, device) -> torch.Tensor:
    """Rows' slot numbers, (B, max_blocks * block_size); rows with fewer blocks padded with
    block 0's slots, which the context_lens mask hides."""
    width = max((len(b) for b in block_lists), default=0)
    ids = torch.tensor([b + [0] * (width - len(b)) for b in block_lists], dtype=torch.long)  # (B, blocks)
    window = ids[:, :, None] * block_size + torch.arange(block_size)  # (B, blocks, block_size)
    return window.reshape(len(block_lists), width * block_size).to(device)


def plan_prefill(chunks, block_size: int, device="cpu", drafts: bool = False) -> StepPlan:
    """chunks: (seq, start, end) with seq.token_ids and seq.block_table.blocks covering end.
    `drafts`: a chunk may run past seq.token_ids into seq.draft (speculative decoding)."""
    if not chunks:
        raise ValueError("a prefill plan needs at least one chunk")
    ids, pos, slots, spans, ctx, last = [], [], [], [], [], []
    for seq, start, end in chunks:
        table = seq.block_table
        n0 = len(ids)
        ids += (seq.token_ids + seq.draft)[start:end] if drafts and seq.draft else seq.token_ids[start:end]
        pos += range(start, end)
        slots += table.slots(start, end)
        spans.append((n0, len(ids), end))
        ctx.append(end)
        last.append(len(ids) - 1)
    return PrefillPlan(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        write_slots=torch.tensor(slots, dtype=torch.long, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.long, device=device),
        slot_window=slot_window([s.block_table.blocks for s, _, _ in chunks], block_size, device),
        logits_at=torch.tensor(last, dtype=torch.long, device=device),
        rows=tuple(s for s, _, _ in chunks),
        row_spans=spans,
        chunks=list(chunks),
    )


def _decode_rows(seqs) -> tuple[list[int], list[int], list[int]]:
    """Each row's newest token, its position (len - 1) and the slot its K/V goes to."""
    if not seqs:
        raise ValueError("a decode plan needs at least one sequence; a warm-up uses warmup.warmup_plan")
    ids = [s.token_ids[-1] for s in seqs]
    pos = [len(s.token_ids) - 1 for s in seqs]
    return ids, pos, [s.block_table.slot(p) for s, p in zip(seqs, pos)]


def plan_decode(seqs, block_size: int, device="cpu") -> StepPlan:
    """One token per row: each sequence's newest token at position len - 1."""
    ids, pos, slots = _decode_rows(seqs)
    n = len(seqs)
    return StepPlan(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        write_slots=torch.tensor(slots, dtype=torch.long, device=device),
        context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.long, device=device),
        slot_window=slot_window([s.block_table.blocks for s in seqs], block_size, device),
        logits_at=torch.arange(n, dtype=torch.long, device=device),
        rows=tuple(seqs),
        is_decode=True,
        row_spans=[(i, i + 1, p + 1) for i, p in enumerate(pos)],
    )


def plan_verify(seqs, block_size: int, device="cpu") -> StepPlan:
    """Decode rows where some carry a draft (speculative decoding), for the fused step: a row
    with draft d1..dk becomes k + 1 one-token rows, its newest token and each draft token, at
    positions len - 1 .. len - 1 + k, each attending over its sequence's window up to and
    including itself. A step writes every row's K/V before any row attends, so the later rows
    see the earlier ones' K/V; each row is computed as a decode row is, so a kept token's logits
    are those a step without drafts gives. row_spans[r] = (first, end, ctx) of sequence r's rows;
    logits come back for every row."""
    ids, pos, slots, ctx, spans, blocks = [], [], [], [], [], []
    for s in seqs:
        n, table = len(s.token_ids), s.block_table
        first = len(ids)
        for j, t in enumerate(s.token_ids[-1:] + s.draft):
            ids.append(t)
            pos.append(n - 1 + j)
            slots.append(table.slot(n - 1 + j))
            ctx.append(n + j)
            blocks.append(table.blocks)
        spans.append((first, len(ids), n + len(s.draft)))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return VerifyPlan(
        input_ids=as_long(ids),
        positions=as_long(pos),
        write_slots=as_long(slots),
        context_lens=as_long(ctx),
        slot_window=slot_window(blocks, block_size, device),
        logits_at=torch.arange(len(ids), dtype=torch.long, device=device),
        rows=tuple(seqs),
        row_spans=spans,
    )


def plan_decode_bucketed(
    seqs, slot_table, buckets: tuple[tuple[int, ...], tuple[int, ...]], inputs=None, device="cpu"
):
    """One token per row, padded up to a (rows, width) bucket (day 52).

    `seqs` must be the slot table's live rows in row order, so the slot window is a view on the
    table (`SlotTable.read`). Padded rows have context_lens 0 (fully masked) and write their K/V
    to the sink slot. With `inputs` (`PersistentInputs`, day 53) the four per-row tensors are
    views on buffers written in place; without, they are new tensors, as in `plan_decode`.
    """
    ids, pos, slots = _decode_rows(seqs)
    row_set, width_set = buckets
    n = len(seqs)
    ctx = [p + 1 for p in pos]
    rows, width = bucket_up(n, row_set), bucket_up(max(ctx), width_set)
    if inputs is not None:
        input_ids, positions, write_slots, context_lens, logits_at = inputs.write(ids, pos, slots, ctx, rows)
    else:
        pad = rows - n
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        input_ids, positions = as_long(ids + [0] * pad), as_long(pos + [0] * pad)
        write_slots = as_long(slots + [slot_table.sink_slot] * pad)
        context_lens, logits_at = as_long(ctx + [0] * pad), torch.arange(rows, device=device)
    return StepPlan(
        input_ids=input_ids,
        positions=positions,
        write_slots=write_slots,
        context_lens=context_lens,
        slot_window=slot_table.read(tuple(range(n)), width, rows - n),
        logits_at=logits_at,
        rows=tuple(seqs),
        is_decode=True,
    )


# --- gates: what a captured step relies on (day 54) -------------------------------------------


def check_mapping_is_window(plan: StepPlan, slot_table) -> None:
    """The plan's slot window is a view on the slot table (same storage, rows from row 0), and
    its real rows are the table's live prefix in order."""
    w, t = plan.slot_window, slot_table.table
    if w.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() or w.data_ptr() != t.data_ptr():
        raise GateError("the slot window is not a view on the slot table's storage from row 0")
    if w.stride() != t.stride():
        raise GateError(f"the slot window's strides {w.stride()} are not the table's {t.stride()}")
    owners = tuple(slot_table.owner[: len(plan.rows)])
    if tuple(plan.rows) != owners:
        raise GateError("the plan's rows are not the slot table's live rows in row order")


def check_window_intact(plan: StepPlan) -> None:
    """Each real row's window holds its sequence's slots for every position it attends to."""
    ctx = plan.context_lens.tolist()
    for r, seq in enumerate(plan.rows):
        if ctx[r] > seq.block_table.capacity:
            raise GateError(
                f"row {r} attends over {ctx[r]} positions, but its block table holds only "
                f"{seq.block_table.capacity} slots"
            )
        want = seq.block_table.slots(0, ctx[r])
        got = plan.slot_window[r, : ctx[r]].tolist()
        if got != want:
            bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise GateError(
                f"row {r}'s window holds slot {got[bad]} at position {bad}; its block table says {want[bad]}"
            )


def check_plan_addressing(plan: StepPlan) -> None:
    """Each real row writes its new K/V where its window says its position lives, and attends
    over exactly the positions up to and including it. For decode plans (one new token a row, the
    steps the fixed-address paths run): a prefill row's chunk has many positions, and this gate
    reads only one."""
    pos, ctx, writes = plan.positions.tolist(), plan.context_lens.tolist(), plan.write_slots.tolist()
    for r in range(len(plan.rows)):
        if ctx[r] != pos[r] + 1:
            raise GateError(f"row {r} sits at position {pos[r]} but attends over {ctx[r]} positions")
        if writes[r] != plan.slot_window[r, pos[r]].item():
            raise GateError(
                f"row {r} writes to slot {writes[r]}, but its window maps position {pos[r]} "
                f"to slot {plan.slot_window[r, pos[r]].item()}"
            )
