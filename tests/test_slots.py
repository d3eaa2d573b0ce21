"""The slot table: windows are views on one storage, live rows stay a prefix."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.slots import SlotTable


def test_window_is_a_view_on_the_table():
    t = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
    t.assign("a", [5, 6, 7])
    t.assign("b", [20, 21])
    w = t.read((0, 1), width=4, pad_rows=2)
    assert w.data_ptr() == t.address and w._base is t.table
    assert w.tolist() == [[5, 6, 7, 99], [20, 21, 99, 99], [99] * 4, [99] * 4]
    t.extend("b", [22])  # a later write shows through the window read earlier
    assert w[1, 2].item() == 22


def test_release_keeps_rows_a_prefix():
    t = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
    for k, slots in [("a", [1]), ("b", [2, 3]), ("c", [4, 5, 6])]:
        t.assign(k, slots)
    assert t.release("a") == ("c", 2, 0)
    assert t.row_of == {"c": 0, "b": 1} and t.owner == ["c", "b"]
    assert t.table[0, :3].tolist() == [4, 5, 6] and t.table[2].tolist() == [99] * 8
    assert t.release("b") is None  # the last row: nothing moves
    assert t.num_live == 1


def test_empty_selection_only_with_padding():
    t = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
    assert t.read((), width=8, pad_rows=4).tolist() == [[99] * 8] * 4
    with pytest.raises(ValueError, match="empty row selection"):
        t.read((), width=8, pad_rows=0)


def test_a_non_prefix_row_set_is_refused():
    t = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
    t.assign("a", [1])
    t.assign("b", [2])
    with pytest.raises(ValueError, match="not a prefix"):
        t.read((1,), width=2)
    with pytest.raises(ValueError, match="not a prefix"):
        t.read((1, 0), width=2)


def test_to_reallocates():
    t = SlotTable(max_batch=2, max_model_len=4, sink_slot=9)
    before = t.address
    window = t.read((), width=4, pad_rows=2)
    t.to("cpu")
    assert t.address != before and window.data_ptr() == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "drop"]), st.integers(0, 10)), max_size=40))
def test_rows_mirror_the_sequences_after_any_history(ops):
    """After any mix of arrivals, growth and departures, each live row holds exactly its
    sequence's slots followed by the sink, and the rows are 0..n-1."""
    t = SlotTable(max_batch=5, max_model_len=12, sink_slot=-1)
    truth: dict[int, list[int]] = {}
    next_key = 0
    for op, n in ops:
        if op == "add" and t.num_live < 5:
            slots = list(range(100 * next_key, 100 * next_key + n % 4))
            t.assign(next_key, slots)
            truth[next_key] = slots
            next_key += 1
        elif op == "grow" and truth:
            k = sorted(truth)[n % len(truth)]
            if len(truth[k]) < 12:
                t.extend(k, [len(truth[k]) + 1000 * k])
                truth[k].append(len(truth[k]) + 1000 * k)
        elif op == "drop" and truth:
            k = sorted(truth)[n % len(truth)]
            t.release(k)
            del truth[k]
        assert sorted(t.row_of.values()) == list(range(len(truth)))
        for k, slots in truth.items():
            row = t.table[t.row_of[k]].tolist()
            assert row == slots + [-1] * (12 - len(slots))
        assert (t.table[len(truth) :] == -1).all()
