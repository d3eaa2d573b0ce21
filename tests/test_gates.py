"""The day-54 gates: each passes on a correctly built plan and fails, naming the fact, on one
built wrongly."""

import pytest
import torch

from nanoserve.buckets import check_pad_inert
from nanoserve.capture import check_addresses_stable, check_replay_rows
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.errors import GateError
from nanoserve.plan import check_mapping_is_window, check_plan_addressing, check_window_intact
from nanoserve.sampling import SamplingParams
from tests.test_engine import tiny_model  # noqa: F401


@pytest.fixture
def running(tiny_model):  # noqa: F811
    """An engine with three sequences decoding in a bucket of four rows, and its next plan."""
    per_block = tiny_model.cfg.kv_bytes_per_token(torch.float32) * 4
    cfg = EngineConfig(
        max_batch=8,
        block_size=4,
        kv_budget=per_block * 200,
        width_multiple=16,
        bucket_decode=True,
        persist_inputs=True,
        capture_decode=True,
    )
    eng = Engine(tiny_model, None, cfg)
    for p in ([1, 2, 3, 4, 5], [6, 7], [8, 9, 10]):
        eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()  # prefill
    eng.step()  # first decode step
    return eng, eng.runner.plan(eng.scheduler.schedule())


def test_gates_pass_on_a_correct_plan(running):
    eng, plan = running
    check_pad_inert(plan, eng.pool.sink_slot)
    check_mapping_is_window(plan, eng.runner.slot_table)
    check_window_intact(plan)
    check_plan_addressing(plan)
    check_addresses_stable(eng.runner.inputs, eng.runner.inputs.addresses)


def test_pad_inert_fails_on_a_padded_row_that_writes(running):
    eng, plan = running
    plan.write_slots[3] = 0  # the padded row now writes into a real block
    with pytest.raises(GateError, match="padded row 3 is not inert"):
        check_pad_inert(plan, eng.pool.sink_slot)


def test_pad_inert_fails_on_a_real_row_writing_to_the_sink(running):
    eng, plan = running
    plan.write_slots[0] = eng.pool.sink_slot
    with pytest.raises(GateError, match="real row 0 writes its K/V to the sink"):
        check_pad_inert(plan, eng.pool.sink_slot)


def test_mapping_is_window_fails_on_a_copy(running):
    eng, plan = running
    plan.slot_window = plan.slot_window.clone()
    with pytest.raises(GateError, match="not a view"):
        check_mapping_is_window(plan, eng.runner.slot_table)


def test_mapping_is_window_fails_on_a_reallocated_table(running):
    eng, plan = running
    eng.runner.slot_table.to("cpu")  # new storage: the window read before is stale
    with pytest.raises(GateError, match="not a view"):
        check_mapping_is_window(plan, eng.runner.slot_table)


def test_window_intact_fails_on_a_stale_entry(running):
    _, plan = running
    plan.slot_window[1, 0] += 1
    with pytest.raises(GateError, match="row 1's window holds slot"):
        check_window_intact(plan)


def test_window_intact_names_a_row_longer_than_its_table(running):
    _, plan = running
    seq = plan.rows[0]
    plan.context_lens[0] = seq.block_table.capacity + 1
    with pytest.raises(GateError, match="row 0 attends over .* its block table holds only"):
        check_window_intact(plan)


def test_plan_addressing_fails_on_a_wrong_write_slot(running):
    _, plan = running
    plan.write_slots[2] += 1
    with pytest.raises(GateError, match="row 2 writes to slot"):
        check_plan_addressing(plan)


def test_addresses_stable_fails_on_a_moved_buffer(running):
    eng, _ = running
    recorded = eng.runner.inputs.addresses
    eng.runner.inputs.positions = eng.runner.inputs.positions.clone()
    with pytest.raises(GateError, match="moved since recording"):
        check_addresses_stable(eng.runner.inputs, recorded)


def test_replay_rows_fails_on_a_mid_run_capture_replayed_over_other_rows(running):
    eng, plan = running
    eng.step()  # records the (4, 16) graph over the three running sequences
    graph = eng.runner.graphs[tuple(plan.slot_window.shape)]
    check_replay_rows(graph, plan)  # same rows: fine
    eng.abort(plan.rows[0].request_id)
    eng.add_request([11, 12], SamplingParams(max_tokens=5))
    eng.step()  # prefill the newcomer
    later = eng.runner.plan(eng.scheduler.schedule())
    assert tuple(later.slot_window.shape) == tuple(plan.slot_window.shape)  # the same graph would replay
    with pytest.raises(GateError, match="froze rows"):
        check_replay_rows(graph, later)


def test_gates_pass_vacuously_on_no_rows(running):
    eng, plan = running
    plan.rows = ()
    plan.write_slots[:] = eng.pool.sink_slot
    plan.context_lens[:] = 0
    check_pad_inert(plan, eng.pool.sink_slot)
    check_window_intact(plan)
    check_plan_addressing(plan)
