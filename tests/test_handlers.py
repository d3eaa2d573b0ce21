"""Running a request (handlers.py): the score budget, and the hand-off from the engine thread.

Each test here failed on the server before these fixes: a request could ask for 256 sequences
of 2,000 tokens with 20 alternatives each (some 10 million scores, gigabytes held and sent) and
was started; and every output of every sample woke the handler's event loop on its own
(one `call_soon_threadsafe` and one `wait_for` timer an output), however far behind the
handler was.
"""

import asyncio
import threading
import time

import httpx
import pytest

import nanoserve.api as api
import nanoserve.responses as responses
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread


@pytest.fixture
def tiny_engine(tmp_path):
    """A tiny model with a 2,048-token context and 8 rows (no tokenizer: prompts are ids)."""
    from tests.test_model import tiny_engine_at

    return tiny_engine_at(tmp_path, context=2048, max_batch=8, blocks=160)


def test_the_default_budget_fits_16_answers_and_refuses_256_long_ones():
    assert api.score_entries(16, 2048, 20) <= api.MAX_SCORE_ENTRIES < api.score_entries(256, 2000, 20)
    assert api.score_entries(4, 100, 5) == 2400 and api.score_entries(1, 0, 1, prompt_tokens=10) == 20


def test_a_request_whose_scores_exceed_the_budget_is_refused_before_it_starts(tiny_engine):
    """256 sequences x 2,000 tokens x 21 scores is over the default budget: a 400 naming the
    fields to lower, at once, with nothing started."""
    body = {"prompt": [[5, 6, 7]] * 16, "n": 16, "max_tokens": 2000, "logprobs": 20, "ignore_eos": True}
    app = create_app(tiny_engine)
    with ServerThread(app) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        streamed = httpx.post(url + "/v1/completions", json=body | {"stream": True}, timeout=30)
        steps = app.state.nanoserve.loop.steps
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "logprobs" and err["code"] == "too_many_scores"
    for field in ("n", "max_tokens", "logprobs", "prompts"):
        assert field in err["message"], (field, err["message"])
    assert "10,752,000 scores" in err["message"] and "at most 1,048,576" in err["message"]
    assert streamed.status_code == 400 and streamed.json()["error"]["code"] == "too_many_scores"
    assert steps == 0 and tiny_engine.allocator.num_used == 0


def test_the_score_budget_is_a_server_option(tiny_engine):
    """With a budget of 1,000 scores: 2 samples x 100 tokens x 5 fit exactly, 101 tokens do
    not; an echoed prompt's scores count too; a request without scores is not limited."""
    with ServerThread(create_app(tiny_engine, max_score_entries=1000)) as url:

        def post(**kw):
            body = {"prompt": [5, 6, 7], "ignore_eos": True, "temperature": 0} | kw
            return httpx.post(url + "/v1/completions", json=body, timeout=60)

        fits = post(n=2, max_tokens=100, logprobs=4, seed=1, temperature=1.0)
        over = post(n=2, max_tokens=101, logprobs=4, seed=1, temperature=1.0)
        echo = post(prompt=list(range(5, 206)), echo=True, max_tokens=0, logprobs=4)
        plain = post(n=2, max_tokens=600, seed=1, temperature=1.0)
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    assert over.status_code == 400 and "1,010 scores" in over.json()["error"]["message"]
    assert echo.status_code == 400 and "201 echoed prompt tokens" in echo.json()["error"]["message"]
    assert plain.status_code == 200, plain.text[:300]


def test_a_handler_behind_the_engine_takes_its_outputs_in_batches(tiny_engine, monkeypatch):
    """8 samples of 50 tokens step together: 400 outputs. The handler is made slower than the
    engine (1 ms to add each output, as when its event loop is busy with other requests), so
    outputs pile up while it works. The engine thread wakes the handler's event loop only when
    the buffer was empty, and the handler sets a liveness timer only when it has nothing to
    take: both counts stay at most one a step, where one an output would be 400."""
    wakeups, timers = [], []
    real_call = asyncio.BaseEventLoop.call_soon_threadsafe
    real_wait_for = asyncio.wait_for
    real_add = responses.Answer.add

    def call_soon_threadsafe(self, *args, **kwargs):
        if threading.current_thread().name == "nanoserve-engine":
            wakeups.append(1)
        return real_call(self, *args, **kwargs)

    def wait_for(*args, **kwargs):
        timers.append(1)
        return real_wait_for(*args, **kwargs)

    def busy_add(self, *args, **kwargs):
        time.sleep(0.001)
        return real_add(self, *args, **kwargs)

    body = {"prompt": [5, 6, 7], "n": 8, "max_tokens": 50, "ignore_eos": True, "seed": 3}
    app = create_app(tiny_engine)
    with ServerThread(app) as url:
        loop = app.state.nanoserve.loop
        monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", call_soon_threadsafe)
        monkeypatch.setattr(asyncio, "wait_for", wait_for)
        monkeypatch.setattr(responses.Answer, "add", busy_add)
        before = loop.steps
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        steps = loop.steps - before
        monkeypatch.undo()
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400
    print(f"400 outputs in {steps} steps: {len(wakeups)} wake-ups, {len(timers)} timers")
    assert len(wakeups) <= steps, f"{len(wakeups)} wake-ups for {steps} steps"
    assert len(timers) <= steps, f"{len(timers)} timers for {steps} steps"
