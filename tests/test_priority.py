"""Priority scheduling (`--scheduling-policy priority`, vLLM's convention: lower runs first).

Under "priority" the waiting queue is ordered by (priority, arrival), decode rows take their
tokens in that order, and the row preempted when blocks run out is the last in it. Under "fcfs"
(the default) a request's `priority` must be 0: a server that would ignore it refuses it.
"""

import httpx
import pytest
import torch

from nanoserve.blocks import BlockAllocator
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.sampling import InvalidParam, SamplingParams
from nanoserve.scheduler import Scheduler, Sequence
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread
from nanoserve.tokenizer import Tokenizer
from tests.test_engine import tiny_engine, tiny_model  # noqa: F401 -- a fixture
from tests.test_faults import simulate


def seq(name, prompt_len, priority=0, max_tokens=4):
    s = Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 4)
    s.max_tokens, s.priority = max_tokens, priority
    return s


def sched(order, blocks=64, max_batch=4, policy="prefill-first"):
    alloc = BlockAllocator(blocks, 4, enable_prefix_caching=False)
    return Scheduler(alloc, max_batch, 64, watermark=None, policy=policy, order=order)


def test_the_queue_is_kept_in_priority_order():
    s = sched("priority")
    for name, prio in [("low", 5), ("high", 0), ("mid", 2), ("high2", 0)]:
        s.add(seq(name, 3, prio))
    assert [q.request_id for q in s.waiting] == ["high", "high2", "mid", "low"]
    s.add(seq("front", 3, 2), front=True)  # the engine's held samples: first of their priority
    assert [q.request_id for q in s.waiting] == ["high", "high2", "front", "mid", "low"]
    f = sched("fcfs")
    for name, prio in [("low", 5), ("high", 0)]:
        f.add(seq(name, 3, prio))  # the scheduler ignores it; the engine refuses it (below)
    assert [q.request_id for q in f.waiting] == ["low", "high"]


def test_one_row_serves_the_highest_priority_first():
    """One row, three requests queued: under priority the last to arrive, at priority 0, runs
    first; under fcfs it runs last."""
    finish = {}
    for order in ("priority", "fcfs"):
        s = sched(order, max_batch=1)
        for name, prio in [("a", 3), ("b", 3), ("urgent", 0)]:
            s.add(seq(name, 3, prio, max_tokens=2))
        done = []
        for _ in range(20):
            before = set(q.request_id for q in s.running)
            simulate(s, 1)
            done += sorted(before - set(q.request_id for q in s.running))
        finish[order] = done
    assert finish["priority"] == ["urgent", "a", "b"]
    assert finish["fcfs"] == ["a", "b", "urgent"]


def pressed_pool(order):
    """6 blocks of 4 tokens, two rows decoding: `old` (priority 5) arrived first, `new`
    (priority 0) second. Each holds 3 blocks once its 12-token prompt is in; the decode of the
    token sampled after it (position 12) needs a fourth block, which neither can get without
    the other's."""
    s = sched(order, blocks=6, max_batch=2)
    old, new = seq("old", 12, priority=5, max_tokens=8), seq("new", 12, priority=0, max_tokens=8)
    s.add(old)
    s.add(new)
    simulate(s, 1)  # both prompts (12 tokens, 3 blocks each) and their first tokens
    assert s.allocator.num_free == 0 and len(old.token_ids) == len(new.token_ids) == 13
    return s, old, new


def test_the_lowest_priority_gives_way_when_blocks_run_out():
    s, old, new = pressed_pool("priority")
    batch = s.schedule()  # each needs a fourth block: one row must give way
    assert batch.decode == [new] and old.num_preemptions == 1 and new.num_preemptions == 0
    assert list(s.waiting) == [old]


def test_fcfs_preempts_the_newest_on_the_same_pool():
    """The same pool under arrival order: the newest (here the urgent one) is preempted, so the
    test above tells the two rules apart (a priority order that fell back to arrival fails it)."""
    s, old, new = pressed_pool("fcfs")
    batch = s.schedule()
    assert batch.decode == [old] and new.num_preemptions == 1


def test_a_preempted_row_goes_back_to_its_place_not_the_front():
    s, old, new = pressed_pool("priority")
    waiting_high = seq("waiting-high", 3, priority=1)
    s.add(waiting_high)
    s.schedule()  # old (priority 5) is preempted
    assert [q.request_id for q in s.waiting] == ["waiting-high", "old"]


def test_the_order_is_checked():
    with pytest.raises(ValueError, match="fcfs, priority"):
        Scheduler(BlockAllocator(4, 4), 1, 16, order="lifo")
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo").validate()


def test_a_priority_under_fcfs_is_refused(tiny_model):  # noqa: F811 -- the fixture
    eng = tiny_engine(tiny_model)
    with pytest.raises(InvalidParam, match="--scheduling-policy priority") as e:
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, priority=1))
    assert e.value.param == "priority" and not eng.requests
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, priority=0))  # 0 is every request's


def test_the_server_says_so_and_serves_it_when_asked(tiny_model):  # noqa: F811 -- the fixture
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "priority": 1}
    with ServerThread(create_app(tiny_engine(tiny_model))) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--scheduling-policy priority" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={**body, "priority": "high"}, timeout=60)
        assert r.status_code == 400  # a number, not a word
    with ServerThread(create_app(tiny_engine(tiny_model, scheduling_policy="priority"))) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_smollm_serves_by_priority_with_the_same_tokens(smollm_dir):
    """The default model, one row: three questions queued, the last at priority 0. Under priority
    it finishes first; each answer is the same greedy text it gets in arrival order."""
    model, tok = load_model(smollm_dir), Tokenizer.from_dir(smollm_dir)
    per_token = model.cfg.kv_bytes_per_token(torch.float32)
    questions = [("capital", "What is the capital of France?", 3), ("sea", "Name a sea.", 3)]
    questions.append(("urgent", "Say hello.", 0))
    results = {}
    for order in ("fcfs", "priority"):
        cfg = EngineConfig(max_batch=1, max_model_len=256, kv_budget=per_token * 512, scheduling_policy=order)
        eng = Engine(model, tok, cfg)
        for name, text, prio in questions:
            prompt = tok.encode_chat([{"role": "user", "content": text}])
            params = SamplingParams(max_tokens=8, temperature=0, priority=prio if order == "priority" else 0)
            eng.add_request(prompt, params, request_id=name)
        finished, texts = [], {}
        while eng.has_unfinished():
            for out in eng.step():
                texts[out.request_id] = texts.get(out.request_id, []) + list(out.new_token_ids)
                if out.finished:
                    finished.append(out.request_id)
        results[order] = finished, texts
        assert eng.allocator.num_used == 0
    assert results["fcfs"][0] == ["capital", "sea", "urgent"]
    assert results["priority"][0] == ["urgent", "capital", "sea"]
    assert results["fcfs"][1] == results["priority"][1]
