"""Decode at fixed addresses (days 51-54): bucketed, persistent and captured decode against eager.

Bucketed, persistent and captured (HostGraph) runs compute the same shapes, so they must agree
bit for bit, logits included. Against unpadded eager decode, only the near-tie rule may excuse
a difference.
"""

import pytest
import torch

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.inputs import PersistentInputs
from nanoserve.sampling import SamplingParams
from tests.test_engine import check_same_or_near_tie, random_requests, run_all, tiny_model  # noqa: F401


def engine(model, **kw):
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * 4
    cfg = dict(
        max_batch=8, block_size=4, kv_budget=per_block * 300, max_num_batched_tokens=64, width_multiple=16
    )
    return Engine(model, None, EngineConfig(**{**cfg, **kw}))


def record_logits(eng):
    """Keep every decode step's logits (and the plan's row count)."""
    seen, execute = [], eng.runner.execute

    def wrapped(plan):
        out = execute(plan)
        if plan.is_decode:
            seen.append(out[: len(plan.rows)].clone())
        return out

    eng.runner.execute = wrapped
    return seen


def test_bucketed_and_persistent_decode_give_eager_tokens(tiny_model):  # noqa: F811
    reqs = random_requests(20, tiny_model.cfg.vocab_size, seed=11, max_tokens=(4, 30))
    eager = [greedy_tokens(tiny_model, p, n) for p, n in reqs]
    plain = engine(tiny_model)
    bucketed = engine(tiny_model, bucket_decode=True)
    persistent = engine(tiny_model, bucket_decode=True, persist_inputs=True)
    captured = engine(tiny_model, bucket_decode=True, persist_inputs=True, capture_decode=True)
    logits = [record_logits(e) for e in (bucketed, persistent, captured)]
    # staggered arrivals: requests join and leave mid-run, so the row set changes between replays
    runs = [run_all(e, reqs, stagger=2) for e in (plain, bucketed, persistent, captured)]
    ties = []
    for (prompt, _), ref, *got in zip(reqs, eager, *runs):
        for g in got:
            check_same_or_near_tie(tiny_model, prompt, ref, g, ties)
    assert runs[1] == runs[2] == runs[3]
    for other in logits[1:]:  # the same shapes computed the same way: bit for bit
        assert len(other) == len(logits[0]) and all(torch.equal(a, b) for a, b in zip(logits[0], other))
    graphs = captured.runner.graphs
    assert 0 < captured.runner.cold_captures == len(graphs) < len(logits[2])  # most steps were replays
    for e in (bucketed, persistent, captured):
        assert e.runner.slot_table.num_live == 0, "every slot-table row comes back"


def test_padded_rows_touch_nothing(tiny_model):  # noqa: F811
    """A bucket of 4 rows over 3 sequences: the padded row writes only the sink slot."""
    eng = engine(tiny_model, bucket_decode=True, persist_inputs=True)
    for p in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        eng.add_request(p, SamplingParams(max_tokens=4))
    eng.step()  # prefill all three
    plan = eng.runner.plan(eng.scheduler.schedule())
    assert plan.input_ids.shape[0] == 4 and len(plan.rows) == 3
    assert plan.context_lens[3].item() == 0 and plan.write_slots[3].item() == eng.pool.sink_slot
    assert plan.slot_window.data_ptr() == eng.runner.slot_table.address  # a window on the table
    assert plan.input_ids.data_ptr() == eng.runner.inputs.input_ids.data_ptr()  # a view on the buffer


def test_persistent_buffers_keep_their_addresses():
    inputs = PersistentInputs(max_batch=4, sink_slot=99)
    before = inputs.addresses
    views = inputs.write([5, 6], [10, 11], [40, 41], [11, 12], rows=4)
    assert views[2].tolist() == [40, 41, 99, 99] and views[3].tolist() == [11, 12, 0, 0]
    inputs.write([7], [3], [8], [4], rows=2)
    assert inputs.addresses == before
    with pytest.raises(ValueError, match="do not fit"):
        inputs.write([1, 2, 3], [0, 0, 0], [0, 0, 0], [1, 1, 1], rows=2)


def test_persist_inputs_needs_buckets():
    with pytest.raises(ValueError, match="needs bucket_decode"):
        EngineConfig(persist_inputs=True).validate()


def test_a_zero_length_row_yields_zeros_not_nan(tiny_model):  # noqa: F811
    from nanoserve.cache import BatchedPagedKVCache
    from nanoserve.plan import StepPlan

    cfg = tiny_model.cfg
    cache = BatchedPagedKVCache(cfg, num_slots=8)
    k = torch.randn(2, cfg.num_kv_heads, cfg.head_dim)
    plan = StepPlan(
        input_ids=torch.tensor([1, 0]),
        positions=torch.tensor([0, 0]),
        write_slots=torch.tensor([0, cache.sink_slot]),
        context_lens=torch.tensor([1, 0]),  # row 1 is padding: nothing visible
        slot_window=torch.tensor([[0, 1], [cache.sink_slot, cache.sink_slot]]),
        logits_at=torch.arange(2),
        is_decode=True,
    )
    cache.write(0, k, k, plan)
    out = cache.paged_attention(0, torch.randn(2, cfg.num_heads, cfg.head_dim), plan)
    assert torch.isfinite(out).all() and (out[1] == 0).all() and (out[0] != 0).any()


@pytest.mark.slow
def test_smollm_bucketed_persistent_captured_decode_matches_eager(smollm_dir):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    model, tok = load_model(smollm_dir), Tokenizer.from_dir(smollm_dir)
    questions = ["What is 2 + 2?", "Name a colour.", "Why is the sky blue?", "Say hi.", "Count to five."]
    reqs = [(tok.encode_chat([{"role": "user", "content": q}]), 10 + 3 * i) for i, q in enumerate(questions)]
    eager = [greedy_tokens(model, p, n) for p, n in reqs]
    for capture in (False, True):
        cfg = EngineConfig(max_batch=8, bucket_decode=True, persist_inputs=True, capture_decode=capture)
        eng = Engine(model, tok, cfg)
        ties = []
        for (prompt, _), ref, got in zip(reqs, eager, run_all(eng, reqs, stagger=2)):
            check_same_or_near_tie(model, prompt, ref, got, ties)
        assert eng.runner.slot_table.num_live == 0
        assert (eng.runner.cold_captures > 0) == capture


def test_warmed_decode_gives_eager_tokens_with_no_cold_captures(tiny_model):  # noqa: F811
    from nanoserve.capture import check_replay_rows
    from nanoserve.warmup import check_no_cold_captures, check_warm_graphs_unbound

    reqs = random_requests(12, tiny_model.cfg.vocab_size, seed=13, max_tokens=(4, 30))
    eager = [greedy_tokens(tiny_model, p, n) for p, n in reqs]
    eng = engine(tiny_model, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=128)
    report = eng.warm_decode()
    assert report.graphs == len(eng.runner.graphs) == 4 * 8  # rows 1,2,4,8 x widths 16..128
    assert report.shapes[0] == (8, 128)  # biggest first
    check_warm_graphs_unbound(eng.runner.graphs)
    execute, replays = eng.runner.execute, []

    def watched(plan):
        if plan.is_decode:
            check_replay_rows(eng.runner.graphs[tuple(plan.slot_window.shape)], plan)
            replays.append(plan)
        return execute(plan)

    eng.runner.execute = watched
    warm_logits = record_logits(eng)
    persistent = engine(tiny_model, bucket_decode=True, persist_inputs=True, max_model_len=128)
    persistent_logits = record_logits(persistent)
    warmed_tokens = run_all(eng, reqs, stagger=2)
    assert warmed_tokens == run_all(persistent, reqs, stagger=2)
    assert len(warm_logits) == len(persistent_logits)
    assert all(torch.equal(a, b) for a, b in zip(warm_logits, persistent_logits))  # bit for bit
    ties = []
    for (prompt, _), ref, got in zip(reqs, eager, warmed_tokens):
        check_same_or_near_tie(tiny_model, prompt, ref, got, ties)
    check_no_cold_captures(eng.runner.cold_captures)
    assert replays and eng.runner.slot_table.num_live == 0


def test_warm_gates_fail_on_wrongly_built_inputs(tiny_model):  # noqa: F811
    from nanoserve.errors import GateError
    from nanoserve.warmup import (
        check_no_cold_captures,
        check_warm_graphs_unbound,
        check_warm_rows_empty,
        check_warm_writes_sink,
        warmup_plan,
    )

    eng = engine(tiny_model, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=64)
    plan = warmup_plan((4, 32), eng.runner.slot_table, eng.runner.inputs)
    check_warm_rows_empty(plan)
    check_warm_writes_sink(plan, eng.pool.sink_slot)
    assert plan.slot_window.data_ptr() == eng.runner.slot_table.address  # a window on the real table
    assert plan.input_ids.data_ptr() == eng.runner.inputs.input_ids.data_ptr()  # the real buffers
    plan.rows = ("somebody",)
    with pytest.raises(GateError, match="no rows"):
        check_warm_rows_empty(plan)
    plan.write_slots[1] = 0
    with pytest.raises(GateError, match=r"warm rows \[1\]"):
        check_warm_writes_sink(plan, eng.pool.sink_slot)
    # a lazily captured graph is bound to the rows it was recorded over
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    while eng.has_unfinished():
        eng.step()
    with pytest.raises(GateError, match="recorded over real rows"):
        check_warm_graphs_unbound(eng.runner.graphs)
    with pytest.raises(GateError, match="recorded mid-run"):
        check_no_cold_captures(eng.runner.cold_captures)


def test_table_budget_and_coverage_gates(tiny_model):  # noqa: F811
    from nanoserve.errors import GateError
    from nanoserve.warmup import (
        check_all_warm,
        check_table_stable,
        check_warm_budget,
        check_warm_touches_nothing,
        warm_shapes,
        width_ceiling,
    )

    eng = engine(tiny_model, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=64)
    eng.add_request([1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=3))
    eng.step()  # real K/V in the pool before the warm-up
    address = eng.runner.slot_table.address
    before = [k.clone() for k in eng.cache.k]
    eng.warm_decode()
    check_warm_touches_nothing(before, eng.cache.k, eng.pool.sink_slot)
    check_table_stable(eng.runner.slot_table, address)
    shapes = warm_shapes(8, 64, 16)
    check_all_warm(shapes, eng.runner.graphs)
    check_warm_budget(shapes, budget_bytes=8 * 4 * 64 * 4, heads=4)
    # and each fails on a wrongly built input
    with torch.inference_mode():  # the pools are inference tensors
        eng.cache.k[0][0, 0, 0] += 1.0
    with pytest.raises(GateError, match=r"real slots \[0\]"):
        check_warm_touches_nothing(before, eng.cache.k, eng.pool.sink_slot)
    eng.runner.slot_table.to("cpu")
    with pytest.raises(GateError, match="slot table moved"):
        check_table_stable(eng.runner.slot_table, address)
    with pytest.raises(GateError, match="no graph"):
        check_all_warm(shapes + [(16, 64)], eng.runner.graphs)
    ceiling = width_ceiling(8 * 4 * 32 * 4, rows=8, heads=4)
    assert ceiling == 32
    with pytest.raises(GateError, match="exceed"):
        check_warm_budget(shapes, budget_bytes=8 * 4 * 32 * 4, heads=4)
    check_warm_budget(warm_shapes(8, 64, 16, max_width=ceiling), budget_bytes=8 * 4 * 32 * 4, heads=4)


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CudaGraph needs a CUDA device; this machine has none"
)
def test_cuda_graphs_give_eager_tokens(tiny_model):  # noqa: F811
    from nanoserve.capture import CudaGraph
    from nanoserve.models import Llama
    from nanoserve.warmup import check_no_cold_captures

    gpu = Llama(tiny_model.cfg, device="cuda")
    gpu.load_state_dict(tiny_model.state_dict())
    reqs = random_requests(12, tiny_model.cfg.vocab_size, seed=17, max_tokens=(4, 30))
    eager = [greedy_tokens(gpu, p, n) for p, n in reqs]
    lazy = engine(gpu, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=128)
    warm = engine(gpu, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=128)
    warm.warm_decode()
    assert all(isinstance(g, CudaGraph) for g in warm.runner.graphs.values())
    ties = []
    for e in (lazy, warm):
        for (prompt, _), ref, got in zip(reqs, eager, run_all(e, reqs, stagger=2)):
            check_same_or_near_tie(gpu, prompt, ref, got, ties)
    check_no_cold_captures(warm.runner.cold_captures)
    assert all(not g.args[0].rows for g in warm.runner.graphs.values())  # warm graphs froze no rows


def test_warmup_batch_attends_to_nothing(tiny_model):  # noqa: F811
    from nanoserve.warmup import warmup_batch

    eng = engine(tiny_model, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=64)
    eng.cache.ensure_pools()
    plan, rows = warmup_batch((4, 32), eng.runner.slot_table, eng.runner.inputs, eng.cache)
    assert rows.plan is plan and plan.rows == ()
    cfg = tiny_model.cfg
    out = rows.attention(0, torch.randn(4, cfg.num_heads, cfg.head_dim))
    assert out.shape == (4, cfg.num_heads, cfg.head_dim) and (out == 0).all()


def test_an_empty_selection_is_refused_outside_the_warm_up(tiny_model):  # noqa: F811
    from nanoserve.plan import plan_decode, plan_decode_bucketed, plan_prefill
    from nanoserve.warmup import warmup_plan

    eng = engine(tiny_model, bucket_decode=True, persist_inputs=True, max_model_len=64)
    runner = eng.runner
    with pytest.raises(ValueError, match="at least one sequence"):
        plan_decode([], 4)
    with pytest.raises(ValueError, match="at least one sequence"):
        plan_decode_bucketed([], runner.slot_table, runner.buckets, runner.inputs)
    with pytest.raises(ValueError, match="at least one chunk"):
        plan_prefill([], 4)
    warm = warmup_plan((2, 16), runner.slot_table, runner.inputs)  # no rows, all padding: legal
    assert eng.cache.view(warm).plan is warm
    empty = warmup_plan((2, 16), runner.slot_table, runner.inputs)
    empty.input_ids = empty.input_ids[:0]
    with pytest.raises(ValueError, match="no tokens at all"):
        eng.cache.view(empty)
