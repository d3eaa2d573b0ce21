"""The engine loop's containment of faults, driven directly (no HTTP in between).

A request whose admission raises something other than a bad request's ValueError (a bug in
`add_request`, half-way through) must end alone: refused with a 500 sentence, whatever the engine
took of it given back, and the loop still serving the requests before and after it. Before this
was contained, the exception escaped `_handle`, killed the loop thread, and every later request
got a 503.
"""

import queue
import time

import pytest

from nanoserve.engine import RequestOutput
from nanoserve.loop import Accepted, EngineLoop, Refused
from nanoserve.sampling import SamplingParams
from tests.test_engine import tiny_engine
from tests.test_model import make_tiny_dir, ours_from_dir


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-loop")
    make_tiny_dir(path, seed=5, max_position_embeddings=256)
    return ours_from_dir(path)


def collect(q: queue.SimpleQueue, timeout: float = 30.0) -> list:
    """A request's items until it ends: Refused, or an output with a finish_reason."""
    items, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            item = q.get(timeout=0.1)
        except queue.Empty:
            continue
        items.append(item)
        if isinstance(item, Refused) or (isinstance(item, RequestOutput) and item.finished):
            return items
    raise AssertionError(f"the request never ended: {items}")


def test_an_admission_that_raises_ends_that_request_alone(tiny_model):
    engine = tiny_engine(tiny_model)
    real_add = engine.add_request

    def add_then_break(prompt, params=None, request_id=None, after=None):
        rid = real_add(prompt, params, request_id=request_id, after=after)
        if request_id == "bad":  # half-way: the engine holds the request, then admission breaks
            raise RuntimeError("planted fault while admitting")
        return rid

    engine.add_request = add_then_break
    loop = EngineLoop(engine)
    loop.start()
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        sinks = {rid: queue.SimpleQueue() for rid in ("first", "bad", "after")}
        for rid, q in sinks.items():
            loop.submit(rid, [5, 6, 7, 8], params, q.put)
        got = {rid: collect(q) for rid, q in sinks.items()}
        assert loop.alive, loop.failure
        refused = got["bad"][-1]
        assert isinstance(refused, Refused) and refused.status == 500
        assert "failed to admit" in refused.message and "RuntimeError" in refused.message
        for rid in ("first", "after"):
            assert isinstance(got[rid][0], Accepted)
            tokens = [t for o in got[rid][1:] for t in o.new_token_ids]
            assert len(tokens) == 8 and got[rid][-1].finish_reason == "length"
        # the half-admitted request is gone from the engine and holds no block
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "bad" not in engine.requests and not engine.has_unfinished()
        assert engine.allocator.num_used == 0
        # and the loop still takes new work
        late = queue.SimpleQueue()
        loop.submit("late", [9, 10], params, late.put)
        assert collect(late)[-1].finish_reason == "length"
    finally:
        loop.stop()
