"""The slot table (day 51): every live sequence's slot numbers in one fixed tensor.

`SlotTable` is a `[max_batch, max_model_len]` int64 tensor: row r, column p is the KV slot of
position p of the sequence that owns row r. It is allocated once and written in place as
sequences grow and leave, so a decode step can read its whole addressing as a *window* on it,
`table[:rows + pad_rows, :width]`: a view on the same storage, never a copy. A graph recorded
over that window (day 54) then reads next step's numbers through the same address.

For the window to be a slice, the live rows must be a prefix of the table. A sequence that
leaves therefore hands its row to the last live sequence (one row copy), and `release` says
which sequence moved where. Unused entries hold `sink_slot` (an index inside every pool that
belongs to no block), so a padded row (day 52) points somewhere harmless even before its mask
hides it.

    t = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
    t.assign("a", [5, 6, 7]); t.assign("b", [20, 21])
    t.read((0, 1), width=4, pad_rows=2)   -> rows 0-1 live, rows 2-3 all 99, a view on t.table
    t.release("a")                          -> ("b", 1, 0): b moved from row 1 to row 0

What it leaves to others: which slots a sequence owns is the allocator's (`blocks.py`); when
rows are padded and how wide a step is, the buckets' (`buckets.py`).
"""

from __future__ import annotations

import torch


class SlotTable:
    def __init__(self, max_batch: int, max_model_len: int, sink_slot: int, device="cpu"):
        self.max_batch, self.max_model_len, self.sink_slot = max_batch, max_model_len, sink_slot
        self.table = torch.full((max_batch, max_model_len), sink_slot, dtype=torch.long, device=device)
        self.row_of: dict = {}  # sequence key -> row
        self.owner: list = []  # row -> sequence key, for the live prefix
        self.lengths: list[int] = []  # row -> positions written

    @property
    def num_live(self) -> int:
        return len(self.owner)

    @property
    def address(self) -> int:
        """Where the table's storage lives: a captured step is bound to this number."""
        return self.table.data_ptr()

    def assign(self, key, slots: list[int] = ()) -> int:
        """Give `key` the next free row (the end of the live prefix), filled with its slots."""
        if key in self.row_of:
            raise ValueError(f"sequence {key!r} already owns row {self.row_of[key]}")
        if self.num_live == self.max_batch:
            raise ValueError(f"all {self.max_batch} rows of the slot table are taken")
        row = self.num_live
        self.row_of[key] = row
        self.owner.append(key)
        self.lengths.append(0)
        self.extend(key, slots)
        return row

    def extend(self, key, slots: list[int]) -> None:
        """Append slot numbers for the next positions of `key`."""
        row, start = self.row_of[key], self.lengths[self.row_of[key]]
        if start + len(slots) > self.max_model_len:
            raise ValueError(
                f"row {row} would hold {start + len(slots)} positions, past {self.max_model_len}"
            )
        if slots:
            self.table[row, start : start + len(slots)] = torch.as_tensor(slots, dtype=torch.long)
        self.lengths[row] = start + len(slots)

    def release(self, key) -> tuple | None:
        """Free `key`'s row, keeping the live rows a prefix: the last live sequence moves into it.
        Returns (moved key, from row, to row), or None when the released row was the last."""
        row = self.row_of.pop(key)
        last = self.num_live - 1
        moved = None
        if row != last:
            mover = self.owner[last]
            self.table[row] = self.table[last]  # one row copy, in place
            self.owner[row], self.lengths[row] = mover, self.lengths[last]
            self.row_of[mover] = row
            moved = (mover, last, row)
        self.table[last].fill_(self.sink_slot)
        self.owner.pop()
        self.lengths.pop()
        return moved

    def sync(self, seqs: list) -> list:
        """Bring the table up to a decode batch of sequences (each with `token_ids` and a
        `block_table`): rows of sequences not in it are released, new ones assigned, every row
        extended to its newest position. Returns the batch in row order, the table's live
        prefix (the runner's decode path and day 51's script both call this)."""
        members = set(seqs)
        for key in [k for k in self.owner if k not in members]:
            self.release(key)
        for seq in seqs:
            n = len(seq.token_ids)
            if seq not in self.row_of:
                self.assign(seq, seq.block_table.slots(0, n))
            else:
                have = self.lengths[self.row_of[seq]]
                self.extend(seq, seq.block_table.slots(have, n))
        return sorted(seqs, key=self.row_of.__getitem__)

    def read(self, rows: tuple[int, ...], width: int, pad_rows: int = 0) -> torch.Tensor:
        """The window `table[:len(rows) + pad_rows, :width]`, a view on the table's storage.

        `rows` must be the live prefix (0, 1, ..., n-1) in order: anything else is not a slice.
        An empty selection is legal only when something is padded (a warm-up batch is all
        padding); a step over nothing at all is a caller's mistake.
        """
        rows = tuple(rows)
        if not rows and pad_rows <= 0:
            raise ValueError("an empty row selection is legal only with pad_rows > 0")
        if rows != tuple(range(len(rows))):
            raise ValueError(f"rows {rows} are not a prefix of the table; a window must start at row 0")
        if len(rows) > self.num_live:
            raise ValueError(f"{len(rows)} rows asked for, {self.num_live} live")
        if pad_rows < 0 or len(rows) + pad_rows > self.max_batch:
            raise ValueError(f"{len(rows)} rows + {pad_rows} padded exceed max_batch {self.max_batch}")
        if not 0 < width <= self.max_model_len:
            raise ValueError(f"width must be in 1..{self.max_model_len}, got {width}")
        return self.table[: len(rows) + pad_rows, :width]

    def to(self, device) -> SlotTable:
        """Move to `device`, always into new storage (even on the same device): every window read
        before points at the old storage, which is what `check_table_stable` catches."""
        self.table = self.table.to(device, copy=True)
        return self
