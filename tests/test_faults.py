"""Serving under faults: no request can hurt another, a dying loop is seen, shutdown drains.

Each test here failed on the server before these fixes: a temperature of 1e-39 ended every
request of its step with a 500; a row whose logits were NaN did the same; an exception outside
the step killed the engine thread while /health stayed 200 and handlers waited forever; SIGTERM
cut streams without an error event; a 10 MB prompt was tokenized on the event loop (what is
checked now is counted, /health's answers while a long prompt is tokenized, not timed);
admission handed a prompt the last free blocks and the next step preempted it; graphs were
recorded for every new shape for the life of the process.
"""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread
from tests.test_engine import check_same_or_near_tie

MAX_BATCH = 4


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    return load_model(smollm_dir), Tokenizer.from_dir(smollm_dir)


def smollm_engine(smollm, **kw) -> Engine:
    model, tok = smollm
    config = EngineConfig(
        max_batch=MAX_BATCH,
        bucket_decode=True,
        persist_inputs=True,
        capture_decode=True,
        max_model_len=1024,
        kv_budget=64 * 2**20,
        **kw,
    )
    engine = Engine(model, tok, config)
    engine.model_name = "SmolLM2-135M-Instruct"
    return engine


@pytest.fixture(scope="module")
def served(smollm):
    engine = smollm_engine(smollm)
    engine.warm_decode(MAX_BATCH, 64)
    with ServerThread(create_app(engine, max_body_bytes=16 * 2**20)) as url:
        yield url, engine


def check_all_free(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (engine.has_unfinished() or engine.allocator.num_used):
        time.sleep(0.01)
    assert engine.allocator.num_used == 0 and not engine.has_unfinished()
    assert not engine.runner.slot_table.row_of, "a slot-table row is still held"


def stream_events(url, body, timeout=120):
    """Every `data:` payload of one streamed completion, parsed (the last is '[DONE]')."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def streamed_ids(events) -> list[int]:
    return [
        t
        for e in events
        if isinstance(e, dict) and "choices" in e
        for c in e["choices"]
        for t in c["token_ids"]
    ]


# --- one request cannot poison a step --------------------------------------------------------------


PROMPTS = ["The capital of France is", "Paged attention stores keys", "Once upon a time there"]


def healthy_streams(url, results):
    """Greedy streams of PROMPTS, each run on its own thread, collected into results."""

    def one(prompt):
        body = {
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        results[prompt] = stream_events(url, body)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    return threads


def check_healthy(results, smollm):
    model, tok = smollm
    for prompt in PROMPTS:
        events = results[prompt]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        ids = tok.encode(prompt)
        check_same_or_near_tie(model, ids, greedy_tokens(model, ids, 24), streamed_ids(events), [])


def test_a_vanishing_temperature_is_greedy_and_hurts_no_one(served, smollm):
    url, engine = served
    results = {}
    threads = healthy_streams(url, results)
    time.sleep(0.3)  # the healthy ones are decoding when the odd one arrives
    odd = {"prompt": "Hello", "max_tokens": 4, "temperature": 1e-39, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=odd, timeout=60)
    for t in threads:
        t.join(120)
    assert r.status_code == 200, r.text
    model, tok = smollm
    ids = tok.encode("Hello")
    check_same_or_near_tie(
        model, ids, greedy_tokens(model, ids, 4, eos_ids=tok.eos_ids), r.json()["choices"][0]["token_ids"], []
    )
    check_healthy(results, smollm)
    check_all_free(engine)


def test_a_row_with_nan_logits_ends_alone(served, smollm, monkeypatch):
    """A planted fault: the runner returns NaN logits for one sampled request's row. That request
    ends with an error event and [DONE]; the greedy streams beside it finish with their
    reference tokens."""
    url, engine = served
    real = engine.runner.execute

    def poisoned(plan):
        logits = real(plan).clone()  # a graph's output buffer is an inference tensor
        for i, seq in enumerate(plan.rows):
            if seq.params.temperature == 0.7:
                logits[i] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    results = {}
    threads = healthy_streams(url, results)
    time.sleep(0.3)
    bad = stream_events(url, {"prompt": "Tell me", "max_tokens": 8, "temperature": 0.7, "seed": 1})
    for t in threads:
        t.join(120)
    assert bad[-1] == "[DONE]" and "error" in bad[-2], bad
    assert "non-finite logits" in bad[-2]["error"]["message"]
    check_healthy(results, smollm)
    check_all_free(engine)


def test_a_row_whose_text_cannot_be_made_ends_alone(smollm):
    """Engine level: one request's detokenizer raises; only that request ends, with "error"."""
    engine = smollm_engine(smollm)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    a, b = engine.add_request("One two three", greedy), engine.add_request("Four five six", greedy)

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted")

    engine.requests[b].detok.add = broken
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    ends = {o.request_id: o for o in outs if o.finished}
    assert ends[b].finish_reason == "error" and "UnicodeDecodeError" in ends[b].error
    assert (
        ends[a].finish_reason == "length"
        and sum(len(o.new_token_ids) for o in outs if o.request_id == a) == 6
    )
    assert engine.allocator.num_used == 0


# --- the loop is watched ---------------------------------------------------------------------------


@pytest.fixture
def tiny_engine(tmp_path):
    from tests.test_model import tiny_engine_at

    return tiny_engine_at(tmp_path, max_batch=1)


def test_a_tokenizer_less_engine_streams_its_tokens_as_they_come(tiny_engine):
    """With no tokenizer there is no text to wait for: each step's token goes out in its own
    chunk (it used to wait for the finish and arrive all at once), and the ids streamed equal
    the model's greedy tokens."""
    prompt, n = [5, 17, 42, 9], 12
    ref = greedy_tokens(tiny_engine.model, prompt, n)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    with ServerThread(create_app(tiny_engine)) as url:
        with httpx.stream(
            "POST", url + "/v1/completions", json=body | {"return_token_ids": True}, timeout=60
        ) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    per_chunk = [len(c["token_ids"]) for e in events for c in e["choices"]]
    assert streamed_ids(events) == ref
    assert len(per_chunk) >= n and max(per_chunk) == 1, per_chunk


def test_a_loop_that_dies_is_reported_and_nobody_waits(tiny_engine):
    """The engine loop is killed from inside, by its own hand-off code (the metrics it updates
    after a step): the request in flight gets an error at once, /health turns 503 "failed" with
    the reason, and a new request gets 503 instead of waiting forever."""
    app = create_app(tiny_engine)

    def boom(*args):
        raise RuntimeError("planted fault in the hand-off")

    app.state.metrics.token = boom
    with ServerThread(app) as url:
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 500 and "planted fault" in r.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "planted fault" in health.json()["error"]
        again = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert again.status_code == 503 and "planted fault" in again.json()["error"]["message"]
    assert tiny_engine.allocator.num_used == 0


def test_a_full_queue_answers_429_while_the_queue_drains(tiny_engine):
    """One row, two places in the queue: the fourth request is refused with a sentence while the
    first runs and two wait; all three admitted ones finish."""
    slow = {"prompt": [5, 6, 7], "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    app = create_app(tiny_engine, max_waiting=2)
    with ServerThread(app) as url:
        done = []
        threads = [
            threading.Thread(
                target=lambda: done.append(httpx.post(url + "/v1/completions", json=slow, timeout=60))
            )
            for _ in range(3)
        ]
        real_step = tiny_engine.step
        tiny_engine.step = lambda: (time.sleep(0.01), real_step())[1]  # slow enough to fill the queue
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(tiny_engine.scheduler.waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(tiny_engine.scheduler.waiting) == 2, "the queue never filled"
        refused = httpx.post(url + "/v1/completions", json=slow, timeout=10)
        for t in threads:
            t.join(60)
    assert refused.status_code == 429 and "2 requests waiting" in refused.json()["error"]["message"]
    assert [r.status_code for r in done] == [200, 200, 200]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in done)


# --- admission that does not thrash ---------------------------------------------------------------


def simulate(sched, steps: int) -> None:
    """Drive a scheduler without a model: a finished prompt or a decode row gains one token."""
    from nanoserve.blocks import NoFreeBlocks  # noqa: F401 -- the scheduler raises none past here

    for _ in range(steps):
        batch = sched.schedule()
        for seq, _, end in batch.chunks:
            seq.num_computed = end
            if end == len(seq.token_ids):
                seq.token_ids.append(1)
        for seq in batch.decode:
            seq.num_computed = len(seq.token_ids)
            seq.token_ids.append(1)
            if len(seq.output_ids) >= seq.max_tokens:
                sched.finish(seq, "length")


def tight_pool(watermark, policy="prefill-first"):
    """6 blocks of 4 tokens. `a` (8 prompt tokens) has sampled its first token, so its next
    decode needs a third block; `b` (15 tokens) arrives and would take the 4 blocks left.
    Prefill-first, where admission runs before decode: the policy the watermark was made for."""
    from nanoserve.blocks import BlockAllocator
    from nanoserve.scheduler import Scheduler, Sequence

    alloc = BlockAllocator(6, 4, enable_prefix_caching=False)
    sched = Scheduler(alloc, max_batch=4, max_num_batched_tokens=64, watermark=watermark, policy=policy)
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=6), 4)
    a.max_tokens = 6
    sched.add(a)
    simulate(sched, 1)  # a's prefill: 2 blocks, one token sampled
    b = Sequence("b", list(range(100, 115)), SamplingParams(max_tokens=4), 4)
    b.max_tokens = 4
    sched.add(b)
    return sched, a, b


def test_a_just_admitted_prompt_is_not_the_next_one_preempted():
    old, a, b = tight_pool(watermark=None)  # the earlier policy: b takes the last free blocks
    simulate(old, 2)
    assert b.num_preemptions == 1 and old.num_preemptions == 1, "the earlier policy did not thrash here"
    assert old.recomputed_tokens == 15  # b's whole prefill, thrown away

    new, a, b = tight_pool(watermark=EngineConfig.watermark)
    first = new.schedule()
    assert not first.chunks and first.decode == [a], "b was admitted into a's next block"
    assert new.reserve() == 0 or new.waiting[0] is b
    simulate(new, 40)
    assert new.num_preemptions == 0 and a.finished and b.finished
    assert new.allocator.num_used == 0

    # the budget policy gives decode rows their blocks before anything is admitted, so even
    # without the reserve b cannot take a's next block
    budget, a, b = tight_pool(watermark=None, policy="budget")
    simulate(budget, 40)
    assert budget.num_preemptions == 0 and a.finished and b.finished


def test_the_watermark_cuts_preemptions_on_a_tight_pool(tmp_path):
    """The throughput workload's shape (random prompts and outputs, ignore_eos) on the tiny model
    with a pool far smaller than the workload: fewer preemptions with the watermark, and the
    same tokens either way. (`python -m nanoserve.bench admission` is this on SmolLM2.)"""
    from nanoserve.bench import throughput_workload
    from tests.test_model import make_tiny_dir, ours_from_dir

    make_tiny_dir(tmp_path, seed=5, max_position_embeddings=256)
    model = ours_from_dir(tmp_path)
    reqs = throughput_workload(48, (8, 96), (8, 64), model.cfg.vocab_size, seed=1)
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    counts, tokens = {}, {}
    for watermark in (None, EngineConfig.watermark):
        config = EngineConfig(max_batch=16, max_model_len=256, kv_budget=per_block * 24, watermark=watermark)
        engine = Engine(model, None, config)
        params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
        outs = engine.generate([p for p, _ in reqs], params, use_tqdm=False)
        counts[watermark] = (engine.scheduler.num_preemptions, engine.scheduler.recomputed_tokens)
        tokens[watermark] = [o.token_ids for o in outs]
        assert engine.allocator.num_used == 0
    new = EngineConfig.watermark
    print(f"preemptions, recomputed tokens: without {counts[None]}, with the watermark {counts[new]}")
    assert counts[new][0] < counts[None][0] and counts[new][1] < counts[None][1]
    assert tokens[None] == tokens[new]


# --- limits ------------------------------------------------------------------------------------------


class HealthPoller:
    """GET /health in a loop on its own thread, counting the answers, until stopped."""

    def __init__(self, url):
        self.url, self.statuses, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.statuses.append(httpx.get(self.url + "/health", timeout=120).status_code)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(150)


def test_health_answers_while_a_long_prompt_is_tokenized(served, monkeypatch):
    """A prompt short enough in characters to be tokenized (165,888 characters, about 69,000
    tokens, then refused: the context is 1,024). While it is being tokenized, the tokenizer
    waits until /health has answered 3 more times: that can only happen if tokenizing leaves
    the event loop free. Counted, not timed; the 60 s bound only ends a wait that never ends,
    as it would with the tokenizer on the event loop."""
    url, engine = served
    real, during = engine.encode_prompt, []
    text = "lorem ipsum " * (engine.max_model_len * engine.tokenizer.max_token_chars // 12)

    def waiting_encode(prompt):
        if prompt == text:
            start = len(poller.statuses)
            deadline = time.monotonic() + 60
            while len(poller.statuses) < start + 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            during.append(len(poller.statuses) - start)
        return real(prompt)

    monkeypatch.setattr(engine, "encode_prompt", waiting_encode)
    with HealthPoller(url) as poller:
        r = httpx.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 4}, timeout=180)
    assert during and during[0] >= 3, f"/health answered {during} times while the prompt was tokenized"
    assert set(poller.statuses) == {200}
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "tokens" in r.json()["error"]["message"]


def test_a_10mb_prompt_is_refused_before_it_is_tokenized(served, monkeypatch):
    """10 MB of text cannot fit 1,024 tokens whatever its tokens: refused by its length in
    characters, the tokenizer never called, /health answering 200 meanwhile."""
    url, engine = served
    calls, real = [], engine.encode_prompt
    monkeypatch.setattr(engine, "encode_prompt", lambda prompt: calls.append(1) or real(prompt))
    big = {"prompt": "lorem ipsum " * (10 * 2**20 // 12), "max_tokens": 4}
    with HealthPoller(url) as poller:
        r = httpx.post(url + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "characters" in r.json()["error"]["message"]
    assert calls == [] and set(poller.statuses) == {200}


def test_a_body_over_the_cap_gets_413(served, tiny_engine):
    url = served[0]
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}', timeout=30)
    assert r.status_code == 413 and "at most 16,777,216 bytes" in r.json()["error"]["message"]
    with ServerThread(create_app(tiny_engine, max_body_bytes=100)) as small:
        ok = httpx.post(small + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        big = httpx.post(small + "/v1/completions", json={"prompt": list(range(60)), "max_tokens": 1})

        def chunked():
            yield b'{"prompt": ['
            yield b"1, " * 60 + b"2]}"

        streamed = httpx.post(small + "/v1/completions", content=chunked())
    assert ok.status_code == 200 and big.status_code == 413 and streamed.status_code == 413, streamed.text


# --- bounded graph memory ------------------------------------------------------------------------


def test_a_shape_past_the_warm_list_runs_eagerly(served, smollm):
    """Warm list up to width 64; a request that grows past it records nothing more, runs its
    wider steps eagerly and still gets the reference tokens; /health and /metrics say so."""
    url, engine = served
    graphs, held = len(engine.runner.graphs), engine.runner.graph_bytes
    eager = engine.runner.eager_steps
    body = {"prompt": "Count: one two three", "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body | {"return_token_ids": True}, timeout=120)
    model, tok = smollm
    ids = tok.encode(body["prompt"])
    check_same_or_near_tie(model, ids, greedy_tokens(model, ids, 80), r.json()["choices"][0]["token_ids"], [])
    assert len(engine.runner.graphs) == graphs and engine.runner.graph_bytes == held
    assert engine.runner.cold_captures == 0 and engine.runner.eager_steps > eager
    warm = httpx.get(url + "/health").json()["warm"]
    assert warm["recording"] == "warm list only" and warm["graph_bytes"] == held == warm["bytes"]
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        for s in f.samples
    }
    assert samples["nanoserve_graph_bytes"] == held
    assert samples["nanoserve_eager_decode_steps_total"] == engine.runner.eager_steps


def test_lazy_recording_stops_at_the_graph_budget(smollm):
    """No warm list: shapes are recorded on first use (day 54) until the graphs hold the budget
    (here about two 4-row graphs); later shapes run eagerly, with the same tokens."""
    model, tok = smollm
    engine = smollm_engine(smollm, graph_budget=2 * 4 * model.cfg.vocab_size * 4 + 1)
    prompts = ["A B C", "One two", "Red green blue", "x"]
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    runner = engine.runner
    assert runner.cold_captures == len(runner.graphs) == 2 and runner.graph_bytes <= runner.graph_budget
    assert runner.eager_steps > 0
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        check_same_or_near_tie(model, ids, greedy_tokens(model, ids, 70), out.token_ids, [])


# --- graceful drain --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_drains_streams_and_exits_0(smollm_dir):
    """A real `nanoserve serve` process, SIGTERM with four streams in flight: three short ones
    finish with their whole answer, the long one is cut at the drain timeout (the default 30 s)
    with an error event and [DONE]; meanwhile /health says 503 "draining" and a new request gets
    503 with Retry-After; the process exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", str(smollm_dir), "--port", str(port), "--max-batch", "4", "--max-model-len", "2048"]
    args += ["--warm-max-width", "64", "--kv-budget", "128MiB"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "serve", *args], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        results, started = {}, {}
        jobs = [("a", 16), ("b", 20), ("c", 24), ("long", 2000)]

        def one(name, n):
            body = {"prompt": f"Story {name}:", "max_tokens": n, "temperature": 0, "ignore_eos": True}
            events = results[name] = []
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                json=body | {"stream": True, "return_token_ids": True},
                timeout=120,
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                        started[name].set()

        threads = []
        for name, n in jobs:
            started[name] = threading.Event()
            threads.append(threading.Thread(target=one, args=(name, n)))
            threads[-1].start()
        for name, _ in jobs:
            assert started[name].wait(60), f"stream {name} never started"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(url + "/health", timeout=5)
        refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        for t in threads:
            t.join(90)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = proc.stderr.read()
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    assert refused.status_code == 503 and refused.headers.get("retry-after") == "5", refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    for name, n in jobs[:3]:
        events = results[name]
        assert events[-1] == "[DONE]" and "choices" in events[-2], (name, events[-2:])
        assert events[-2]["choices"][0]["finish_reason"] == "length", (name, events[-2:])
        assert len(streamed_ids(events)) == n
    long = results["long"]
    assert long[-1] == "[DONE]" and "drain timeout is 30 s" in long[-2]["error"]["message"], long[-2:]
    assert 0 < len(streamed_ids(long)) < 2000
    assert code == 0, stderr
    assert "nanoserve: draining" in stderr and "1 request(s) cut at the drain timeout" in stderr, stderr


def test_sigint_before_ready_just_exits(smollm_dir):
    """Ctrl-C while the model is still loading: nothing was admitted, the process exits 0."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.cli", "serve", "--model", str(smollm_dir), "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/health", timeout=2)
            break
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    code, stderr = proc.wait(timeout=60), proc.stderr.read()
    assert code == 0, stderr
    assert "nanoserve: stopping (the engine was loading)" in stderr or "(the engine was warming)" in stderr, (
        stderr
    )
