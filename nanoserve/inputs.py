"""Persistent inputs (day 53): a decode step's four small tensors, written in place every step.

`plan_decode` builds `input_ids`, `positions`, `write_slots` and `context_lens` as new tensors
every step: new storage, new addresses. A captured step (day 54) can only read numbers through
the addresses it was recorded with, so with `persist_inputs` the plan instead writes the step's
numbers into four `[max_batch]` buffers allocated once, and hands out views of their first
`rows` entries. Padded rows (day 52) get token 0 at position 0, `write_slots` = the sink slot
and `context_lens` 0: they compute something and touch nothing.

`logits_at` is the fifth buffer, `arange(max_batch)`, never written: decode samples every row.
"""

from __future__ import annotations

import torch


class PersistentInputs:
    def __init__(self, max_batch: int, sink_slot: int, device="cpu"):
        kw = dict(dtype=torch.long, device=device)
        self.max_batch, self.sink_slot = max_batch, sink_slot
        self.input_ids = torch.zeros(max_batch, **kw)
        self.positions = torch.zeros(max_batch, **kw)
        self.write_slots = torch.full((max_batch,), sink_slot, **kw)
        self.context_lens = torch.zeros(max_batch, **kw)
        self.logits_at = torch.arange(max_batch, **kw)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.write_slots, self.context_lens, self.logits_at

    @property
    def addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.buffers())

    def write(self, ids, positions, slots, context_lens, rows: int) -> tuple[torch.Tensor, ...]:
        """Write n real rows and pad to `rows`; return views (input_ids, positions, write_slots,
        context_lens, logits_at), each of length `rows`, on the buffers' storage."""
        n = len(ids)
        if not n <= rows <= self.max_batch:
            raise ValueError(f"{n} real rows do not fit a bucket of {rows} rows (max_batch {self.max_batch})")
        values = (ids, positions, slots, context_lens)
        pads = (0, 0, self.sink_slot, 0)
        for buf, vals, pad in zip(self.buffers(), values, pads):
            if n:
                buf[:n].copy_(torch.as_tensor(vals, dtype=torch.long), non_blocking=True)
            buf[n:rows].fill_(pad)
        return tuple(b[:rows] for b in self.buffers())
