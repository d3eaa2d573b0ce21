"""What an answer holds while it is made (responses.py), and where its tokens' text starts.

Each test here failed on the server before these fixes: a choice kept every token's scores as
the engine's Python objects (about 2 KB a token with 20 alternatives) until the request
ended, streamed or not; and `text_offset` was the length of the text emitted so far, so a token
whose text a stop string held back shared its offset with the next one.
"""

import gc
import json
import sys
import types

import httpx
import pytest

import nanoserve.responses as responses
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread


def held_bytes(obj) -> int:
    """Bytes reachable from obj through containers, arrays and attributes, each object once
    (types, modules and functions left out): what an object keeps alive."""
    seen, stack, total = set(), [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


@pytest.fixture
def tiny_engine(tmp_path):
    from tests.test_model import tiny_engine_at

    return tiny_engine_at(tmp_path, context=256)


def test_packed_scores_are_the_engine_scores_exactly():
    """float32 columns lose nothing: the engine's log-probabilities are float32 to begin with.
    A position without a score (a prompt's first) stays one, and a short list keeps its length."""
    import torch

    from nanoserve.sampling import TokenLogprobs, logprobs_of

    torch.manual_seed(0)
    targets = torch.randint(0, 49152, (50,)).tolist()
    entries = [None, *logprobs_of(torch.randn(50, 49152), targets, 20), TokenLogprobs(7, -0.5, [(7, -0.5)])]
    cols = responses.ScoreColumns.of(entries, 20)
    assert len(cols) == 52 and not cols.scored(0) and cols.alternatives(51, 20) == [(7, -0.5)]
    for i, e in enumerate(entries[1:-1], start=1):
        assert cols.ids[i] == e.token_id and cols.values[i] == e.logprob
        assert cols.alternatives(i, 20) == [tuple(p) for p in e.top] and cols.alternatives(i, 3) == e.top[:3]
    assert cols.nbytes == 52 * 21 * 8


SCORED = {"prompt": [5, 17, 42, 9], "max_tokens": 64, "logprobs": 20, "ignore_eos": True, "temperature": 0}


def test_a_choice_keeps_its_scores_packed(tiny_engine, monkeypatch):
    """Measured when the answer is rendered: what each choice holds, a token, with 20
    alternatives a token. Packed (an id and a float32 a score) it is 21 x 8 = 168 bytes of
    scores plus the token's id and offset."""
    seen = []
    real = responses.Answer.whole

    def spy(self, picked=None):
        seen.extend((held_bytes(c), len(c.token_ids)) for c in self.choices)
        return real(self, picked)

    monkeypatch.setattr(responses.Answer, "whole", spy)
    with ServerThread(create_app(tiny_engine)) as url:
        r = httpx.post(url + "/v1/completions", json=SCORED, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == 64 and all(len(t) >= 20 for t in lp["top_logprobs"])
    ((size, tokens),) = seen
    assert tokens == 64
    print(f"a choice holds {size / tokens:.0f} bytes a token with 20 alternatives")
    assert size / tokens < 400, f"{size / tokens:.0f} bytes a token"


def test_a_streamed_choice_keeps_nothing_it_has_sent(tiny_engine, monkeypatch):
    """Two samples streamed with scores: after each chunk, the choice it came from holds no
    token, no score and no text, and what it holds does not grow with the tokens sent."""
    after = []
    real = responses.Answer.chunk

    def spy(self, k, *args, **kwargs):
        event = real(self, k, *args, **kwargs)
        c = self.choices[k]
        after.append((len(c.token_ids), held_bytes(c)))
        return event

    monkeypatch.setattr(responses.Answer, "chunk", spy)
    body = SCORED | {"n": 2, "seed": 1, "temperature": 1.0, "stream": True, "return_token_ids": True}
    with ServerThread(create_app(tiny_engine)) as url:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            frames = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    ids = [t for f in frames for c in f["choices"] for t in c["token_ids"]]
    scores = [s for f in frames for c in f["choices"] for s in c["logprobs"]["token_logprobs"]]
    assert len(ids) == len(scores) == 128 and len(after) >= 128
    assert all(held == 0 for held, _ in after), [held for held, _ in after][:20]
    assert after[-1][1] <= after[1][1] + 256, (
        f"{after[1][1]} bytes after the second chunk, {after[-1][1]} at the end"
    )


# --- text offsets, through the server on SmolLM2 ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_server(smollm_dir):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm_dir)
    engine = Engine(load_model(smollm_dir), tok, EngineConfig(max_batch=4, max_model_len=512))
    engine.model_name = "SmolLM2-135M-Instruct"
    with ServerThread(create_app(engine)) as url:
        yield url, tok


def offsets_of(tok, ids: list[int]) -> tuple[list[int], list[str]]:
    """Where each token's text starts in the detokenized text, and the text each one adds."""
    detok, offsets, pieces = tok.detokenizer(), [], []
    for t in ids:
        offsets.append(len(detok.text))
        pieces.append(detok.add(t))
    return offsets, pieces


def test_text_offsets_index_the_text_when_a_stop_string_holds_text_back(smollm_server):
    """The stop string is a token's text followed by a character the model never writes, so
    that token's text is held back until the next token shows it is not a stop. The offsets
    must still index the returned text: text[offset_i:offset_i+1] is token i's text (whole, and
    also streamed, and behind an echoed prompt)."""
    url, tok = smollm_server
    body = {
        "prompt": "The three primary colors are",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    free = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    ids = free["token_ids"]
    want, pieces = offsets_of(tok, ids)
    held = next(i for i in range(2, len(ids) - 2) if pieces[i].strip() and pieces[i + 1])
    stop = pieces[held] + "\x00"

    r = httpx.post(url + "/v1/completions", json=body | {"stop": [stop]}, timeout=120)
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == ids and choice["text"] == free["text"]  # the stop never matched
    text, got = choice["text"], choice["logprobs"]["text_offset"]
    assert got == want
    assert got[held + 1] - got[held] == len(pieces[held]) > 0, (got[held], got[held + 1], pieces[held])
    for i in range(len(ids) - 1):
        assert text[got[i] : got[i + 1]] == pieces[i], i

    # streamed: the held token goes out with the next one, each with its own offset
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stop": [stop], "stream": True}) as s:
        frames = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [o for f in frames for c in f["choices"] for o in c["logprobs"]["text_offset"]]
    assert streamed == want and any(len(f["choices"][0]["token_ids"]) > 1 for f in frames)

    # behind an echoed prompt: the same offsets, moved by the prompt's length
    echoed = httpx.post(url + "/v1/completions", json=body | {"stop": [stop], "echo": True}, timeout=120)
    offsets = echoed.json()["choices"][0]["logprobs"]["text_offset"]
    assert offsets[-len(ids) :] == [len(body["prompt"]) + o for o in want]
