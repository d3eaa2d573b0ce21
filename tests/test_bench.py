"""The benchmark's own judgements: how it reports where a peer's greedy tokens part from ours."""

from types import SimpleNamespace

import pytest

from nanoserve.bench import agreement, decode_turns, describe_difference, first_difference, scores_at
from nanoserve.generate import greedy_tokens


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_agreement_is_how_the_tables_write_it():
    assert agreement([1, 2, 3], [1, 2, 3]) == "equal"
    assert agreement([1, 2, 3], [1, 5, 3]) == "differ at 1"
    assert agreement([1, 2], [1, 2, 3]) == "differ at 2"


class FakeEngine:
    """generate() answers n tokens counting up from `start`; `drift` moves the start by one on
    each whole run of n_tokens, an engine whose greedy tokens change between turns."""

    def __init__(self, start=0, drift=False, n_tokens=6):
        self.start, self.drift, self.n_tokens = start, drift, n_tokens

    def generate(self, prompts, params, use_tqdm=False):
        out = list(range(self.start, self.start + params.max_tokens))
        if self.drift and params.max_tokens == self.n_tokens:
            self.start += 1
        return [SimpleNamespace(token_ids=out)]


def test_decode_turns_keeps_each_engines_tokens_and_refuses_tokens_that_change():
    best, tokens = decode_turns({"a": FakeEngine(0), "b": FakeEngine(7)}, [1, 2], 6, reps=2)
    assert set(best) == {"a", "b"} and all(r > 0 for r in best.values())
    assert tokens == {"a": [0, 1, 2, 3, 4, 5], "b": [7, 8, 9, 10, 11, 12]}
    with pytest.raises(AssertionError, match="other tokens on another turn"):
        decode_turns({"a": FakeEngine(0), "moving": FakeEngine(0, drift=True)}, [1, 2], 6, reps=2)


def test_a_peers_difference_comes_with_both_tokens_scores(tmp_path):
    """Where a peer's tokens part from ours the report names both tokens and our log-probability
    of each there: ours ranks first, the runner-up is a near miss, and a token we rank past our
    top 20 is said to be so (a broken peer or a broken us, not a near tie)."""
    from tests.test_model import tiny_engine_at

    engine = tiny_engine_at(tmp_path)
    prompt = [5, 17, 42, 9]
    ours = greedy_tokens(engine.model, prompt, 6)
    assert describe_difference(engine, prompt, ours, list(ours)) == "equal"

    top = scores_at(engine, prompt, ours[:3], (ours[3],), top=2)[0]
    from nanoserve.sampling import SamplingParams

    engine.add_request(prompt + ours[:3], SamplingParams(max_tokens=1, logprobs=20))
    ranked = []
    while engine.has_unfinished():
        for out in engine.step():
            ranked = out.logprobs[0].top if out.logprobs else ranked
    (a, la), (b, lb) = ranked[0], ranked[1]
    assert a == ours[3] and abs(la - top) < 1e-6 and lb <= la
    theirs = ours[:3] + [b, 1, 2]
    assert (
        describe_difference(engine, prompt, ours, theirs)
        == f"differ at 3 (ours {a} {la:.3f}, theirs {b} {lb:.3f})"
    )

    outside = next(t for t in range(engine.model.cfg.vocab_size) if t not in dict(ranked))
    far = describe_difference(engine, prompt, ours, ours[:3] + [outside])
    assert far == f"differ at 3 (ours {a} {la:.3f}, theirs {outside} outside our top 20)"
    assert describe_difference(engine, prompt, ours, ours[:4]) == "differ at 4 (one is shorter)"
