"""The server against real clients: uvicorn on loopback, the official `openai` client, raw HTTP.

One server runs the default model (SmolLM2-135M) for the module, with the day 51-56 decode path
on (buckets, persistent inputs, captured graphs, a warm list) and an API key. Greedy answers are
compared with the plain eager path (`generate.greedy_tokens`), under the batched engine's
near-tie rule (tests/test_engine.py).
"""

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine, build_engine
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams
from nanoserve.serve import boot_line, create_app
from nanoserve.threads import ServerThread
from nanoserve.warmup import check_no_cold_captures, warm_shapes
from tests.test_engine import check_same_or_near_tie

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BATCH = 8


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    return load_model(smollm_dir), Tokenizer.from_dir(smollm_dir)


@pytest.fixture(scope="module")
def served(smollm):
    model, tok = smollm
    config = EngineConfig(
        max_batch=MAX_BATCH, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=2048
    )
    engine = Engine(model, tok, config)
    engine.model_name = "SmolLM2-135M-Instruct"
    engine.warm_decode(MAX_BATCH, 128)
    app = create_app(engine, api_key=KEY)
    with ServerThread(app) as url:
        yield url, engine, app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0)


def reference(smollm, ids, n):
    model, tok = smollm
    return greedy_tokens(model, ids, n, eos_ids=tok.eos_ids)


def wait_idle(engine, timeout=10.0):
    """Until the engine holds no request and no block (the loop frees them within a step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished() and engine.allocator.num_used == 0:
            return
        time.sleep(0.01)
    raise AssertionError(
        f"still busy: {len(engine.scheduler.running)} running, {engine.allocator.num_used} blocks used"
    )


def check_all_free(engine):
    wait_idle(engine)
    assert engine.allocator.num_used == 0
    assert not engine.runner.slot_table.row_of, "a slot-table row is still held"
    engine.allocator.check_invariants([])


# --- the openai client ---------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    (card,) = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct"


def test_completion_matches_the_eager_path(client, smollm, served):
    prompt = "The three primary colours are"
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (choice,) = resp.choices
    ids = smollm[1].encode(prompt)
    ref = reference(smollm, ids, 12)
    check_same_or_near_tie(smollm[0], ids, ref, choice.token_ids, [])
    assert choice.text == smollm[1].decode(choice.token_ids)
    assert choice.finish_reason == ("length" if len(ref) == 12 else "stop")
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(choice.token_ids)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    check_all_free(served[1])


def test_chat_matches_the_eager_path(client, smollm):
    messages = [{"role": "user", "content": "Name three planets."}]
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40, temperature=0
    )
    ids = smollm[1].encode_chat(messages)
    ref = reference(smollm, ids, 40)
    text = smollm[1].decode([t for t in ref if t not in smollm[1].eos_ids])
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == ("stop" if ref[-1] in smollm[1].eos_ids else "length")
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(ref)


def test_streaming_chat_equals_the_whole_answer_and_reports_usage(client):
    kw = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Write a haiku about memory."}],
        max_tokens=24,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_streaming_completion_and_stop_strings(client):
    kw = dict(model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == whole
    cut = whole[: whole.index(",", 1)] if "," in whole[1:] else None
    if cut is not None:
        stopped = client.completions.create(**kw, stop=[","]).choices[0]
        assert stopped.finish_reason == "stop" and "," not in stopped.text


def test_seeded_sampling_repeats(client):
    kw = dict(
        model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=7
    )
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    c = client.completions.create(**(kw | {"seed": 8})).choices[0].text
    assert a == b and a != c


# --- bad input, raw HTTP -------------------------------------------------------------------------

LONG = "hello " * 2100  # more tokens than the fixture's 2048-token context
HI = {"role": "user", "content": "hi"}
PART = {"type": "text", "text": "hi"}

BAD = [
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    # scores and several answers: the limits
    ("POST", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "hi", "n": "2"}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("POST", "/v1/completions", {"prompt": "hi", "best_of": 17}, 400, "best_of"),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    ("POST", "/v1/completions", {"prompt": ["hi"] * 32, "n": 16}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": ["hi"] * 65}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ["hi", ""]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [[1, 2], [999999]]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [HI], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("POST", "/v1/chat/completions", {"messages": [HI], "logprobs": 1}, 400, "logprobs"),
    ("POST", "/v1/chat/completions", {"messages": [HI], "n": 17}, 400, "n"),
    ("POST", "/v1/chat/completions", {"messages": [HI], "echo": True}, 400, "echo"),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("POST", "/v1/completions", {"prompt": [999999]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    # values that would poison a step, or change the answer without this server doing it
    ("POST", "/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [HI], "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    ("POST", "/v1/chat/completions", {"messages": [HI], "top_logprobs": 3}, 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"messages": [HI], "tool_choice": "auto"}, 400, "tool_choice"),
    # served since issue 32, so out of their ranges here (tests/test_penalties.py has the rest)
    ("POST", "/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("POST", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": None}]},
        400,
        "messages.0.content",
    ),
    # structured output since issue 32: a grammar the library refuses (tests/test_grammar.py has more)
    ("POST", "/v1/completions", {"prompt": "hi", "guided_json": {"type": "nonsense"}}, 400, "guided_json"),
    ("POST", "/v1/completions", {"prompt": "hi", "guided_regex": "(ab"}, 400, "guided_regex"),
    # sizes past the caps
    ("POST", "/v1/completions", {"prompt": "hi", "stop": ["x" * 257]}, 400, "stop"),
    ("POST", "/v1/chat/completions", {"messages": [HI] * 1025}, 400, "messages"),
    (
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [PART] * 65}]},
        400,
        "messages",
    ),
    ("POST", "/v1/completions", {"prompt": "a" * (2048 * 162 + 1)}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "a" * (4 * 2**20)}, 413, None),
    ("POST", "/v1/completions", b'{"prompt": "hi \\ud800 there"}', 400, "prompt"),
    (
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages",
    ),
    ("GET", "/v1/nothing-here", None, 404, None),
    ("GET", "/v1/completions", None, 405, None),
    ("DELETE", "/v1/chat/completions", None, 405, None),
]


def send(url, method, path, body, headers=AUTH):
    if isinstance(body, bytes):
        return httpx.request(
            method, url + path, content=body, headers=headers | {"Content-Type": "application/json"}
        )
    return httpx.request(method, url + path, json=body, headers=headers)


@pytest.mark.parametrize("method,path,body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_an_error_object_and_a_4xx(served, method, path, body, status, param):
    r = send(served[0], method, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and len(err["message"]) > 10 and "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param or param in err["message"], err


def test_bad_input_leaves_requests_in_flight_untouched(served, smollm):
    """A long streaming request runs while every bad input above is thrown at the server; it
    finishes with the tokens it would have had alone."""
    url, engine = served[:2]
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
    body = {
        "messages": messages,
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    got, finish = [], []

    def stream():
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        got.extend(c.get("token_ids") or [])
                        if c["finish_reason"]:
                            finish.append(c["finish_reason"])

    t = threading.Thread(target=stream)
    t.start()
    for method, path, payload, status, _ in BAD:
        assert send(url, method, path, payload).status_code == status
    t.join(timeout=120)
    ids = smollm[1].encode_chat(messages)
    ref = greedy_tokens(smollm[0], ids, 48)  # ignore_eos: no end-of-sequence stop
    check_same_or_near_tie(smollm[0], ids, ref, got, [])
    assert finish == ["length"] and len(got) == 48
    check_all_free(engine)


def test_api_key_is_enforced(served):
    url = served[0]
    body = {"prompt": "hi", "max_tokens": 2}
    assert send(url, "POST", "/v1/completions", body, headers={}).status_code == 401
    r = send(url, "POST", "/v1/completions", body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert send(url, "GET", "/v1/models", None, headers={}).status_code == 401
    assert send(url, "POST", "/v1/completions", body).status_code == 200
    bad_client = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(url + "/metrics").status_code == 200


# --- disconnects ---------------------------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_everything(served):
    url, engine = served[:2]
    body = {
        "prompt": "Count slowly:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
        assert engine.allocator.num_used > 0 and len(engine.runner.slot_table.row_of) == 1
        steps = served_loop(served).steps
    check_all_free(engine)
    # freed within a step or two of the close (one may have been running when it happened)
    assert served_loop(served).steps - steps <= 3


def test_a_non_streaming_client_that_gives_up_is_aborted(served):
    url, engine = served[:2]
    body = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    check_all_free(engine)


def served_loop(served):
    """The EngineLoop behind the module's server (the app keeps its state on app.state)."""
    return served[2].state.nanoserve.loop


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_parse_and_count(served, client):
    url, engine = served[:2]
    client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi there", max_tokens=5, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    for name in [
        "nanoserve_requests_running",
        "nanoserve_requests_waiting",
        "nanoserve_kv_blocks_used",
        "nanoserve_kv_blocks_total",
        "nanoserve_preemptions",
        "nanoserve_time_to_first_token_seconds",
        "nanoserve_inter_token_latency_seconds",
        "nanoserve_prompt_tokens",
        "nanoserve_generation_tokens",
        "nanoserve_requests",
        "nanoserve_warm_graphs",
    ]:
        assert name in families, name
    value = lambda name, suffix="": next(s.value for s in families[name].samples if s.name == name + suffix)
    assert value("nanoserve_kv_blocks_used") == 0 and value("nanoserve_requests_running") == 0
    assert value("nanoserve_kv_blocks_total") == engine.pool.num_blocks
    assert value("nanoserve_time_to_first_token_seconds", "_count") >= 1
    assert value("nanoserve_generation_tokens", "_total") >= 5
    assert value("nanoserve_warm_graphs") == len(warm_shapes(MAX_BATCH, 2048, 32, MAX_BATCH, 128))


# --- soak ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_soak_200_requests_16_clients(served, smollm):
    """200 requests from 16 concurrent clients over reused keep-alive connections (half
    streaming chat, half completions), 20 of them hanging up mid-stream and a bad request thrown
    in after every tenth: nothing lost (every request answered, finished or known to be gone),
    every block and row free at the end, the same greedy tokens as Engine.generate, and the
    server still answering."""
    url, engine = served[:2]
    model, tok = smollm
    rng = random.Random(0)
    words = "cache block token batch model server request memory page slot fast slow the a of".split()
    jobs = []
    for i in range(200):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 30)))
        jobs.append((i, text, rng.randint(2, 20)))
    leavers = set(rng.sample([i for i, _, n in jobs if i % 2 == 0 and n >= 6], 20))
    local = threading.local()  # one openai client (one keep-alive pool) per worker thread

    def client():
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        return local.client

    def run(job):
        i, text, n = job
        if i % 10 == 5:  # a bad request on the same connection: answered, and nothing else moves
            with pytest.raises(openai.BadRequestError):
                client().completions.create(model="SmolLM2-135M-Instruct", prompt=text, max_tokens=n, seed=-1)
        if i % 2:
            resp = client().completions.create(
                model="SmolLM2-135M-Instruct",
                prompt=text,
                max_tokens=n,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            return resp.choices[0].token_ids, resp.choices[0].finish_reason
        stream = client().chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": text}],
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        ids, finish = [], None
        for chunk in stream:
            for c in chunk.choices:
                ids.extend(getattr(c, "token_ids", None) or [])
                finish = c.finish_reason or finish
            if i in leavers and len(ids) >= 2:
                stream.close()  # the client hangs up mid-stream
                return ids, "left"
        return ids, finish

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, jobs))
    prompts = [[{"role": "user", "content": t}] if i % 2 == 0 else t for i, t, _ in jobs]
    ref_engine = Engine(model, tok, EngineConfig(max_batch=32))
    refs = ref_engine.generate(prompts, [SamplingParams(max_tokens=n) for _, _, n in jobs], use_tqdm=False)
    ties, left = [], 0
    for (i, _, _), (ids, finish), ref in zip(jobs, got, refs):
        if finish == "left":
            left += 1
            check_same_or_near_tie(model, ref.prompt_token_ids, ref.token_ids[: len(ids)], ids, ties)
            continue
        assert finish in ("stop", "length"), (i, finish)
        check_same_or_near_tie(model, ref.prompt_token_ids, ref.token_ids, ids, ties)
        if ids == ref.token_ids:
            assert finish == ref.finish_reason
    assert len(got) == 200 and left == 20
    check_all_free(engine)
    check_no_cold_captures(engine.runner.cold_captures)
    assert httpx.get(url + "/health").json()["status"] == "ok"
    after = client().completions.create(model="SmolLM2-135M-Instruct", prompt="Still there?", max_tokens=3)
    assert after.choices[0].finish_reason in ("stop", "length")
    print(f"soak: 200 requests, 20 left mid-stream, 20 bad ones refused, near-ties {len(ties)}")


# --- day 56: warming before the door opens --------------------------------------------------------


def test_health_goes_503_to_200_across_the_warm_up(smollm_dir, capfd):
    phases, release = [], threading.Event()

    def builder(on_phase):
        def gate(phase):
            phases.append(phase)
            on_phase(phase)
            if phase == "warming":
                assert release.wait(60)

        config = EngineConfig(
            model=str(smollm_dir),
            max_batch=4,
            bucket_decode=True,
            persist_inputs=True,
            capture_decode=True,
            warm_max_width=64,
        )
        return build_engine(config, on_phase=gate)

    with ServerThread(create_app(builder, address="test")) as url:
        deadline = time.monotonic() + 60
        while phases[-1:] != ["warming"]:
            r = httpx.get(url + "/health")
            assert r.status_code == 503 and r.json()["status"] in ("loading", "warming")
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "warming"
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "warming" in r.json()["error"]["message"]
        release.set()
        while (r := httpx.get(url + "/health")).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        health = r.json()
        assert phases == ["loading", "warming"]
        expected = warm_shapes(4, 8192, 32, 4, 64)
        assert health["warm"]["graphs"] == len(expected) == 6
        assert [tuple(s) for s in health["warm"]["shapes"]] == expected
        assert health["warm"]["max_rows"] == 4 and health["warm"]["max_width"] == 64
        assert health["pool"]["num_blocks"] * health["pool"]["block_size"] == health["pool"]["num_slots"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    err = capfd.readouterr().err
    boot = [
        ln for ln in err.splitlines() if ln.startswith("nanoserve: ") and "listening on http://test" in ln
    ]
    assert len(boot) == 1 and "warm list 6 graphs" in boot[0] and "KV pool 728 blocks" in boot[0]


def test_a_builder_that_fails_is_reported_not_served():
    def builder(on_phase):
        on_phase("loading")
        raise ValueError("max_model_len 99999 is longer than the model's context of 8192 tokens")

    reasons = []
    with ServerThread(create_app(builder, on_failure=reasons.append)) as url:
        deadline = time.monotonic() + 10
        while not reasons:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "99999" in r.json()["error"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "99999" in r.json()["error"]["message"]


def test_build_engine_warms_the_trimmed_list_and_serves_without_cold_captures(smollm_dir, smollm):
    config = EngineConfig(
        model=str(smollm_dir),
        max_batch=4,
        max_model_len=512,
        bucket_decode=True,
        persist_inputs=True,
        capture_decode=True,
        warm_max_width=96,
    )
    engine = build_engine(config)
    report = engine.warm_report
    assert report.max_rows == 4 and report.max_width == 96 and report.width_ceiling > 96
    assert report.shapes == warm_shapes(4, 512, 32, 4, 96) and set(engine.runner.graphs) == set(report.shapes)
    assert report.bytes == sum(
        r * 49152 * 4 for r, _ in report.shapes
    )  # HostGraph outputs: rows x vocab fp32
    prompts = [[{"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?", "Name a colour.")]
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    check_no_cold_captures(engine.runner.cold_captures)
    for messages, out in zip(prompts, outs):
        ids = smollm[1].encode_chat(messages)
        check_same_or_near_tie(smollm[0], ids, greedy_tokens(smollm[0], ids, 20), out.token_ids, [])
    # the same run without the warm-up records its graphs in front of the requests
    lazy = build_engine(EngineConfig(**{**config.__dict__, "warm": False}))
    lazy.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert lazy.warm_report is None and lazy.runner.cold_captures > 0
    with pytest.raises(Exception, match="recorded mid-run"):
        check_no_cold_captures(lazy.runner.cold_captures)


def test_the_width_ceiling_of_the_free_memory_trims_the_list(smollm_dir, monkeypatch):
    import nanoserve.warmup as warmup

    heads = 9
    monkeypatch.setattr(warmup, "warm_budget_bytes", lambda device, reserve_bytes=0: 2 * heads * 4 * 100)
    config = EngineConfig(
        model=str(smollm_dir), max_batch=2, bucket_decode=True, persist_inputs=True, capture_decode=True
    )
    engine = build_engine(config)
    assert engine.warm_report.width_ceiling == 100 and engine.warm_report.max_width == 100
    assert engine.warm_report.shapes == warm_shapes(2, 8192, 32, 2, 100)  # widths 32, 64, 96


def test_boot_line_names_everything(served):
    line = boot_line(served[1], "127.0.0.1:8000")
    for part in [
        "SmolLM2-135M-Instruct",
        "fp32 on cpu",
        "KV pool",
        "blocks x 16",
        "tokens",
        "MB",
        "warm list",
        "graphs",
        "http://127.0.0.1:8000",
    ]:
        assert part in line, part


# --- the command ---------------------------------------------------------------------------------


def nanoserve(*args, timeout=120):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "nanoserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_serve_help_documents_every_option():
    out = nanoserve("serve", "--help").stdout
    for option in [
        "--host",
        "--port",
        "--api-key",
        "--max-batch",
        "--max-model-len",
        "--kv-budget",
        "--no-capture",
        "--no-warm",
        "--warm-max-rows",
        "--warm-max-width",
        "--max-waiting",
        "--max-body-bytes",
        "--max-score-entries",
        "--served-model-name",
        "--drain-timeout",
        "--graph-budget",
        "--watermark",
        "--schedule",
        "--max-num-batched-tokens",
        "--model",
        "--dtype",
        "--threads",
    ]:
        assert option in out, option


@pytest.mark.parametrize(
    "args,words",
    [
        (["--port", "70000"], "--port must be between"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--max-batch", "0"], "max_batch must be at least 1"),
        (["--kv-budget", "lots"], "lots"),
        (["--warm-max-width", "0"], "warm_max_width must be at least 1"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be at least 1"),
        (["--max-score-entries", "0"], "--max-score-entries must be at least 1"),
    ],
)
def test_serve_mistakes_are_one_line(args, words):
    r = nanoserve("serve", *args)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoserve: error:") and words in lines[0], r.stderr


def test_serve_refuses_a_port_in_use(smollm_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = nanoserve("serve", "--model", str(smollm_dir), "--port", str(s.getsockname()[1]))
    assert r.returncode == 1 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr


# --- a tiny engine: queue limits and a failing step -----------------------------------------------


@pytest.fixture
def tiny_engine(tmp_path):
    from tests.test_model import tiny_engine_at

    return tiny_engine_at(tmp_path)


def test_a_step_that_fails_ends_its_requests_and_the_server_goes_on(tiny_engine, monkeypatch):
    real, calls = tiny_engine.runner.execute, []

    def flaky(plan):
        calls.append(plan)
        if len(calls) == 2:
            raise RuntimeError("simulated kernel failure")
        return real(plan)

    monkeypatch.setattr(tiny_engine.runner, "execute", flaky)
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    with ServerThread(create_app(tiny_engine)) as url:
        failed = httpx.post(url + "/v1/completions", json=body)
        ok = httpx.post(url + "/v1/completions", json=body | {"return_token_ids": True})
    assert failed.status_code == 500 and "aborted" in failed.json()["error"]["message"]
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4
    assert tiny_engine.allocator.num_used == 0 and not tiny_engine.has_unfinished()


def test_a_key_outside_ascii_is_compared_as_utf8_bytes(tiny_engine):
    """The key and the header are compared as bytes: the key's UTF-8 opens the door, and a
    wrong header outside ASCII (or not UTF-8 at all) is a 401 with an error object, not a 500."""
    key = "clé-ключ"
    body = {"prompt": [5, 6, 7], "max_tokens": 2}
    with ServerThread(create_app(tiny_engine, api_key=key)) as url:

        def post(authorization: bytes):
            headers = {"Authorization": authorization}
            return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)

        right = post(b"Bearer " + key.encode())
        wrong = [
            post("Bearer ключ".encode()),
            post(b"Bearer \xe9\xff"),
            post(b"Bearer " + key.encode("latin-1", "replace")),
        ]
    assert right.status_code == 200, right.text
    for r in wrong:
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_an_unexpected_error_in_a_route_is_a_500_error_object(tiny_engine, monkeypatch, capfd):
    """A bug in a route (planted: the prompt's encoding raises something no handler expects)
    gets OpenAI's error object with status 500 and a sentence; the traceback goes to the
    server's stderr, not to the client; the server goes on."""

    def broken(prompt):
        raise RuntimeError("planted bug with a secret path /srv/weights")

    monkeypatch.setattr(tiny_engine, "encode_prompt", broken)
    with ServerThread(create_app(tiny_engine)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
        after = httpx.get(url + "/v1/models", timeout=30)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert "RuntimeError" in err["message"] and len(err["message"].split()) > 8
    assert "Traceback" not in r.text and "/srv/weights" not in r.text
    assert after.status_code == 200
    logged = capfd.readouterr().err
    assert "Traceback" in logged and "planted bug" in logged


def test_the_generated_docs_are_off_behind_an_api_key(tiny_engine):
    """With a key, /docs, /redoc and /openapi.json are not served, with or without the key (a
    browser page cannot send it); without a key they are."""
    with ServerThread(create_app(tiny_engine, api_key="k")) as url:
        for path in ("/docs", "/redoc", "/openapi.json"):
            for headers in ({}, {"Authorization": "Bearer k"}):
                r = httpx.get(url + path, headers=headers, timeout=30)
                assert r.status_code == 404 and "no route" in r.json()["error"]["message"], (
                    path,
                    r.text[:200],
                )
    with ServerThread(create_app(tiny_engine)) as url:
        assert httpx.get(url + "/openapi.json", timeout=30).json()["info"]["title"] == "nanoserve"
        assert httpx.get(url + "/docs", timeout=30).status_code == 200


def test_served_model_names_are_the_names_a_request_may_give(tiny_engine):
    """--served-model-name: /v1/models lists each, a request may name any, answers carry the
    first, another name is a 404 that lists them; /health says the family and weight types."""
    names = ["smol", "gpt-4o-mini"]
    with ServerThread(create_app(tiny_engine, served_model_names=names)) as url:
        cards = httpx.get(f"{url}/v1/models").json()["data"]
        assert [c["id"] for c in cards] == names
        body = {"prompt": [5, 17, 42], "max_tokens": 2, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body | {"model": "gpt-4o-mini"})
        assert r.status_code == 200 and r.json()["model"] == "smol"
        r = httpx.post(f"{url}/v1/completions", json=body | {"model": "tiny"})
        assert r.status_code == 404
        assert r.json()["error"]["message"].endswith("this server serves 'smol', 'gpt-4o-mini'")
        health = httpx.get(f"{url}/health").json()
        assert health["served_model_names"] == names and health["model"] == "smol"
        assert health["family"] == "llama" and health["weight_types"] == ["float32"]
    with pytest.raises(ValueError, match="one or more non-empty strings"):
        create_app(tiny_engine, served_model_names=[""])


def test_the_boot_line_names_a_family_other_than_llama(tiny_engine):
    import dataclasses

    assert "(llama)" not in boot_line(tiny_engine)
    tiny_engine.model.cfg = dataclasses.replace(tiny_engine.model.cfg, family="qwen2")
    assert boot_line(tiny_engine).startswith(f"nanoserve: {tiny_engine.model_name} (qwen2) · fp32 on cpu")
