"""The server's small endpoints and HTTP operations: /tokenize, /detokenize, /version, request ids,
the access log and CORS (http_extras.py), against uvicorn on loopback as tests/test_serve.py runs it.

The tokenizer endpoints need a real tokenizer, so they run on the default model (SmolLM2-135M,
eager, a small pool: nothing here decodes more than one token); the rest runs on the tiny
random-weight engine, which has no tokenizer. Each expectation is computed without the server
(the tokenizer itself, the engine's own rendering), so a server that tokenized, rendered or
echoed differently would fail here.
"""

import re

import httpx
import pytest

import nanoserve
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.http_extras import AccessLog, cors_options, parse_list
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [
    {"role": "developer", "content": "You answer in one word."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Name a "},
            {"type": "text", "text": "planet."},
        ],
    },
]
# MESSAGES as the chat template takes them (serve.chat_messages): developer is system, parts joined
RENDERED = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a planet."},
]


@pytest.fixture(scope="module")
def smol(smollm_dir):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm_dir)
    engine = Engine(
        load_model(smollm_dir),
        tok,
        EngineConfig(max_batch=2, max_model_len=512, kv_budget=32 * 2**20),
    )
    engine.model_name = "SmolLM2-135M-Instruct"
    with ServerThread(create_app(engine, api_key=KEY)) as url:
        yield url, engine, tok


@pytest.fixture
def tiny_engine(tmp_path):
    from tests.test_model import tiny_engine_at

    return tiny_engine_at(tmp_path)


def post(url, path, body, headers=AUTH):
    """POST `body` as JSON; a str is sent as it is (JSON that Python's encoder would not write)."""
    if isinstance(body, str):
        headers = headers | {"Content-Type": "application/json"}
        return httpx.post(url + path, content=body.encode(), headers=headers, timeout=60)
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def assert_error(r, status, param, *words):
    """A refusal in the server's error shape: the status, the field it names, a sentence."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert "Traceback" not in r.text
    for w in words:
        assert w in err["message"], err["message"]


# --- /tokenize, /detokenize ----------------------------------------------------------------------


def test_tokenize_a_prompt_gives_the_tokenizers_ids(smol):
    url, engine, tok = smol
    prompt = "The KV cache keeps every past key and value: héllo, 世界!"
    r = post(url, "/tokenize", {"model": "SmolLM2-135M-Instruct", "prompt": prompt})
    assert r.status_code == 200, r.text
    ids = tok.encode(prompt)
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    r = post(url, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert r.json()["token_strs"] == [tok.backend.id_to_token(t) for t in ids]
    assert "Ġ" in "".join(r.json()["token_strs"])  # the vocabulary's own strings, as vLLM gives them


def test_add_special_tokens_puts_the_bos_where_the_tokenizer_would(smol, monkeypatch):
    """vLLM's defaults: a prompt gets the tokenizer's BOS, messages do not (their template writes
    its own). SmolLM2 adds none, so the test makes it add one to see the switch work."""
    url, engine, tok = smol
    monkeypatch.setattr(tok, "add_bos_token", True)
    plain = tok.encode("Hello world", add_bos=False)
    chat = tok.encode(tok.apply_chat_template(RENDERED), add_bos=False)

    def tokens(body):
        r = post(url, "/tokenize", body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert tokens({"prompt": "Hello world"}) == [tok.bos_id, *plain]
    assert tokens({"prompt": "Hello world", "add_special_tokens": False}) == plain
    assert tokens({"messages": MESSAGES}) == chat
    assert tokens({"messages": MESSAGES, "add_special_tokens": True}) == [
        tok.bos_id,
        *chat,
    ]


def test_tokenize_messages_counts_what_the_chat_endpoint_sends(smol):
    url, engine, tok = smol
    r = post(url, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == engine.encode_prompt(RENDERED) == tok.encode_chat(RENDERED)
    assert body["count"] == len(body["tokens"])
    chat = post(
        url,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 1, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == body["count"]
    r = post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    bare = tok.encode(tok.apply_chat_template(RENDERED, add_generation_prompt=False), add_bos=False)
    assert r.json()["tokens"] == bare and bare != body["tokens"]


def test_detokenize_gives_the_text_back(smol):
    url, engine, tok = smol
    prompt = "Round trip: 3.14, naïve café, 東京."
    ids = post(url, "/tokenize", {"prompt": prompt}).json()["tokens"]
    r = post(url, "/detokenize", {"model": "SmolLM2-135M-Instruct", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": prompt}, r.text
    # chat tokens come back with their special tokens: the rendered prompt, as vLLM gives it
    ids = post(url, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    text = post(url, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == tok.apply_chat_template(RENDERED) and "<|im_start|>" in text
    assert post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_an_id_outside_the_vocabulary_is_a_400_naming_the_field(smol):
    url, engine, tok = smol
    vocab = tok.vocab_size
    r = post(url, "/detokenize", {"tokens": [19556, vocab]})
    assert_error(r, 400, "tokens", "tokens[1]", str(vocab), "vocabulary")
    assert_error(post(url, "/detokenize", {"tokens": [-1]}), 400, "tokens", "tokens[0] is -1")
    assert_error(post(url, "/detokenize", {"tokens": [5, "6"]}), 400, "tokens.1")
    assert_error(post(url, "/detokenize", {"tokens": 5}), 400, "tokens")
    assert_error(post(url, "/detokenize", {}), 400, "tokens", "required")


@pytest.mark.parametrize(
    "body,status,param,words",
    [
        ({}, 400, "prompt", ["either 'prompt'", "'messages'"]),
        (
            {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            400,
            "messages",
            ["not both"],
        ),
        ({"prompt": 5}, 400, "prompt", []),
        ({"messages": []}, 400, "messages", []),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", []),
        (
            {"prompt": "a", "continue_final_message": True},
            400,
            "continue_final_message",
            [],
        ),
        ({"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens", []),
        ('{"prompt": "a\\ud800b"}', 400, "prompt", ["lone surrogate"]),
        ({"prompt": "a", "model": "gpt-4"}, 404, "model", ["'gpt-4' does not exist"]),
    ],
)
def test_bad_tokenize_input_is_a_sentence_naming_the_field(smol, body, status, param, words):
    assert_error(post(smol[0], "/tokenize", body), status, param, *words)


def test_the_tokenizer_endpoints_need_the_key_and_version_does_not(smol):
    url = smol[0]
    for path, body in [
        ("/tokenize", {"prompt": "a"}),
        ("/detokenize", {"tokens": [1]}),
    ]:
        r = post(url, path, body, headers={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.get(url + "/version", timeout=30)
    assert r.status_code == 200 and r.json() == {"version": nanoserve.__version__}
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", r.json()["version"])


def test_an_engine_without_a_tokenizer_says_so(tiny_engine):
    with ServerThread(create_app(tiny_engine)) as url:
        assert_error(post(url, "/tokenize", {"prompt": "hi"}, {}), 400, "prompt", "no tokenizer")
        assert_error(
            post(url, "/detokenize", {"tokens": [1, 2]}, {}),
            400,
            "tokens",
            "no tokenizer",
        )


# --- X-Request-Id and the access log -------------------------------------------------------------


def test_x_request_id_is_echoed_on_every_response_and_made_when_absent(tiny_engine, monkeypatch):
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    with ServerThread(create_app(tiny_engine)) as url:
        sent = {"X-Request-Id": "trace-42/abc"}
        answers = [
            httpx.get(url + "/health", headers=sent),
            httpx.post(url + "/v1/completions", json=body, headers=sent),
            httpx.post(url + "/v1/completions", json=body | {"max_tokens": "3"}, headers=sent),  # 400
            httpx.get(url + "/nowhere", headers=sent),  # 404
        ]
        with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, headers=sent) as r:
            events = list(r.iter_lines())
            answers.append(r)
        assert "data: [DONE]" in events
        assert [a.status_code for a in answers] == [200, 200, 400, 404, 200]
        for a in answers:
            assert a.headers["x-request-id"] == "trace-42/abc", a.url
        made = [httpx.get(url + "/version").headers["x-request-id"] for _ in range(2)]
        assert all(re.fullmatch(r"[0-9a-f]{24}", m) for m in made) and made[0] != made[1]
        # an id that cannot be echoed safely is refused by name, and the answer carries a new one
        for bad in ["has space", "x" * 257, "tab\there"]:
            r = httpx.get(url + "/health", headers={"X-Request-Id": bad})
            assert_error(r, 400, "X-Request-Id", "X-Request-Id", "visible ASCII")
            assert re.fullmatch(r"[0-9a-f]{24}", r.headers["x-request-id"])
        # a route that fails unexpectedly answers 500 outside the middleware: the id is still on it
        monkeypatch.setattr(tiny_engine, "encode_prompt", lambda p: 1 / 0)
        r = httpx.post(url + "/v1/completions", json=body, headers=sent)
        assert r.status_code == 500 and r.headers["x-request-id"] == "trace-42/abc", r.text


def test_the_answer_id_is_built_on_the_request_id(tiny_engine):
    """vLLM's ids: cmpl-<X-Request-Id> (chatcmpl- on chat), the generated id when none is sent, so
    the answer, the header and the access log name the request alike; two requests in flight with
    the same id are still two requests to the engine."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ServerThread(create_app(tiny_engine)) as url:
        with ThreadPoolExecutor(2) as pool:
            same = list(
                pool.map(
                    lambda _: httpx.post(
                        url + "/v1/completions",
                        json=body,
                        headers={"X-Request-Id": "twin"},
                    ),
                    range(2),
                )
            )
        r = httpx.post(url + "/v1/completions", json=body)
    for a in same:
        assert a.status_code == 200 and a.json()["id"] == "cmpl-twin", a.text
        assert a.json()["usage"]["completion_tokens"] == 8
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]


def access_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("nanoserve: ") and "request_id=" in ln]


def test_the_access_log_writes_one_line_per_request(tiny_engine, capfd):
    app = create_app(tiny_engine, access_log=True)
    with ServerThread(app) as url:
        capfd.readouterr()
        httpx.get(url + "/health", headers={"X-Request-Id": "probe-1"})
        httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 0})  # 400
        httpx.get(url + "/forged%0ananoserve:%20fake")  # a 404 whose path tries to forge a line
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        app.state.access_log.flush()
        lines = access_lines(capfd.readouterr().err)
    assert len(lines) == 4, lines
    health, bad, forged, ok = lines
    assert re.fullmatch(
        r'nanoserve: 127\.0\.0\.1:\d+ "GET /health" 200 \d+\.\dms request_id=probe-1',
        health,
    ), health
    assert '"POST /v1/completions" 400 ' in bad and re.search(r"request_id=[0-9a-f]{24}$", bad)
    assert '"GET /forged%0anANOSERVE:%20FAKE" 404 '.lower() in forged.lower() and "\n" not in forged
    assert '"POST /v1/completions" 200 ' in ok and ok.endswith(f"request_id={r.headers['x-request-id']}")


def test_the_access_log_is_off_by_default_and_skips_the_paths_it_is_told(tiny_engine, capfd):
    with ServerThread(create_app(tiny_engine)) as url:
        capfd.readouterr()
        assert httpx.get(url + "/health").status_code == 200
        assert not access_lines(capfd.readouterr().err)
    app = create_app(tiny_engine, access_log=True, access_log_skip=("/health", "/metrics"))
    with ServerThread(app) as url:
        capfd.readouterr()
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(url + path).status_code == 200
        app.state.access_log.flush()
        lines = access_lines(capfd.readouterr().err)
    assert len(lines) == 1 and '"GET /version" 200' in lines[0], lines


def test_a_full_access_log_drops_lines_instead_of_blocking(capfd, monkeypatch):
    log = AccessLog(capacity=2)
    # hold the writer thread back, so the queue fills as a stderr nobody reads would fill it
    import threading

    gate = threading.Event()
    real_write = log._run.__func__

    def slow_run(self):
        gate.wait(5)
        real_write(self)

    monkeypatch.setattr(AccessLog, "_run", slow_run)
    for i in range(5):
        log.write(f"nanoserve: line {i}")
    assert log.dropped == 3
    gate.set()
    log.flush()
    # the count goes out with the first line written after the drops
    assert capfd.readouterr().err.splitlines() == [
        "nanoserve: line 0",
        "nanoserve: 3 access log line(s) dropped: stderr was not read in time",
        "nanoserve: line 1",
    ]


# --- CORS ----------------------------------------------------------------------------------------


PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization",
}


def test_cors_answers_the_allowed_origin_only(tiny_engine):
    app = create_app(tiny_engine, api_key=KEY, allowed_origins=["https://app.example"])
    with ServerThread(app) as url:
        ok = httpx.options(
            url + "/v1/completions",
            headers={"Origin": "https://app.example", **PREFLIGHT},
        )
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        r = httpx.get(url + "/health", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        # a refusal behind the key (401) still carries the header, so the page can read why
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": [5]},
            headers={"Origin": "https://app.example"},
        )
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
        evil = httpx.options(
            url + "/v1/completions",
            headers={"Origin": "https://evil.example", **PREFLIGHT},
        )
        assert_error(evil, 400, "Origin", "https://evil.example", "--allowed-origins")
        assert "access-control-allow-origin" not in evil.headers
        r = httpx.get(url + "/health", headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_without_allowed_origins_there_are_no_cors_headers(tiny_engine):
    with ServerThread(create_app(tiny_engine)) as url:
        r = httpx.options(
            url + "/v1/completions",
            headers={"Origin": "https://app.example", **PREFLIGHT},
        )
        assert_error(r, 405, None, "does not accept OPTIONS")
        r2 = httpx.get(url + "/health", headers={"Origin": "https://app.example"})
        for resp in (r, r2):
            assert not [h for h in resp.headers if h.lower().startswith("access-control-")], resp.headers


def test_origins_and_lists_are_checked():
    assert parse_list('["https://a.example", "http://localhost:3000"]', "--x") == [
        "https://a.example",
        "http://localhost:3000",
    ]
    assert parse_list("https://a.example, http://localhost:3000", "--x") == [
        "https://a.example",
        "http://localhost:3000",
    ]
    assert parse_list(None, "--x") is None and parse_list("", "--x") is None
    for bad in ['["a", 1]', "[not json", "a,,b", '{"a": 1}']:
        with pytest.raises(ValueError, match="--x"):
            parse_list(bad, "--x")
    assert cors_options(["*"])["allow_origins"] == ["*"]
    for bad in ["app.example", "https://app.example/", "https://app.example/path", ""]:
        with pytest.raises(ValueError, match="--allowed-origins"):
            cors_options([bad] if bad else [])
