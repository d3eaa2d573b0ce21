"""Sampling penalties and vLLM's sampling fields (issue 32): presence, frequency and repetition
penalties, min_p, logit_bias, stop_token_ids, min_tokens and include_stop_str_in_output.

Each is held to a hand computation on small fixed logits (the expected numbers are written out
or computed by the plain loops below, never by the code under test), to the unset path at its
neutral value, and through the engine and the server. Each gate comes with a case that a wrongly
built input would fail: a frequency penalty that counted the prompt, a repetition penalty that
ignored it, min_tokens counted over the prompt, min_p before temperature, min_p after top-p.
"""

from collections import Counter

import httpx
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nanoserve.sampling as sampling
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.sampling import SamplingParams, adjust_logits, filter_batch, filter_logits, sample, sample_rows
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread
from nanoserve.tokenizer import IncrementalDetokenizer
from tests.test_model import make_tiny_dir, ours_from_dir, prefill_logits

# --- by hand, on fixed logits ---------------------------------------------------------------------


def adjusted(logits, params, history=None, eos_ids=()):
    """adjust_logits over every row of a (B, V) list of lists."""
    t = torch.tensor(logits, dtype=torch.float32)
    return adjust_logits(t, params, list(range(len(params))), history, eos_ids).tolist()


def test_frequency_and_presence_count_the_output_only():
    """logits [1, 2, 3, 0.5]; prompt [2, 2, 2], output [1, 1, 3]; f 0.5, p 0.25:
    token 1: 2 - 0.5 * 2 - 0.25 = 0.75; token 3: 0.5 - 0.5 * 1 - 0.25 = -0.25; token 2 is only
    in the prompt and keeps its 3 (counting the prompt would make it 3 - 1.5 - 0.25 = 1.25)."""
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25).validate()
    (row,) = adjusted([[1.0, 2.0, 3.0, 0.5]], [p], [([2, 2, 2, 1, 1, 3], 3)])
    assert row == pytest.approx([1.0, 0.75, 3.0, -0.25], abs=1e-6)


def test_presence_is_once_and_frequency_is_per_occurrence():
    """Output [0, 0, 0, 1]: presence 1 takes 1 from tokens 0 and 1 alike; frequency 1 takes 3
    from token 0 and 1 from token 1."""
    logits = [[5.0, 5.0, 5.0]]
    history = [([0, 0, 0, 0, 1], 1)]  # prompt [0]: not counted by either
    (pres,) = adjusted(logits, [SamplingParams(presence_penalty=1.0)], history)
    (freq,) = adjusted(logits, [SamplingParams(frequency_penalty=1.0)], history)
    assert pres == pytest.approx([4.0, 4.0, 5.0]) and freq == pytest.approx([2.0, 4.0, 5.0])
    (neg,) = adjusted(logits, [SamplingParams(frequency_penalty=-2.0)], history)  # a negative one rewards
    assert neg == pytest.approx([11.0, 7.0, 5.0])


def test_repetition_divides_positive_and_multiplies_negative_over_prompt_and_output():
    """logits [2, -1, 0.5, 3, -2], prompt [0], output [1], r 2: token 0 (prompt) 2 / 2 = 1,
    token 1 (output) -1 * 2 = -2, the rest as they were. A penalty that skipped the prompt
    would leave token 0 at 2."""
    p = SamplingParams(repetition_penalty=2.0)
    (row,) = adjusted([[2.0, -1.0, 0.5, 3.0, -2.0]], [p], [([0, 1], 1)])
    assert row == pytest.approx([1.0, -2.0, 0.5, 3.0, -2.0])
    (row,) = adjusted([[2.0, -1.0, 0.5, 3.0, -2.0]], [SamplingParams(repetition_penalty=0.5)], [([0, 1], 1)])
    assert row == pytest.approx([4.0, -0.5, 0.5, 3.0, -2.0])  # below 1 it rewards repeats


def test_repetition_comes_before_frequency_and_presence_and_bias_before_both():
    """vLLM's order. Token 0 with logit 2, once in the output, r 2, f 0.5, p 0.25:
    2 / 2 - 0.5 - 0.25 = 0.25 (the other order, (2 - 0.75) / 2, is 0.625). Token 1 with logit
    -1 and a bias of 4, in the prompt, r 2: (-1 + 4) / 2 = 1.5 (penalty first: -2 + 4 = 2)."""
    p = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={1: 4.0}
    )
    (row,) = adjusted([[2.0, -1.0, 0.0]], [p.validate()], [([1, 0], 1)])
    assert row == pytest.approx([0.25, 1.5, 0.0])


def test_logit_bias_is_added_and_moves_the_greedy_token():
    """[0, 0, 0] with {1: 5, 2: -100} -> [0, 5, -100]; greedy takes token 1, and a sampled
    row never draws token 2 (e^-100 of the mass)."""
    p = SamplingParams(logit_bias={1: 5.0, 2: -100.0}).validate()
    assert adjusted([[0.0, 0.0, 0.0]], [p]) == [[0.0, 5.0, -100.0]]
    logits = torch.tensor([[3.0, 0.0, 2.9]])
    assert sample(logits, [p], [None]).tolist() == [1]
    hot = SamplingParams(temperature=1.0, seed=0, logit_bias={0: -100.0}).validate()
    g = hot.make_generator()
    assert 0 not in {int(sample(logits, [hot], [g])[0]) for _ in range(50)}


def test_penalties_change_the_greedy_token_but_not_its_logprob():
    """Greedy is the argmax of the penalized logits; the score the engine reports stays the
    raw distribution's (raw_logprobs): sample_rows leaves the logits it was given alone."""
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    raw = logits.clone()
    p = SamplingParams(frequency_penalty=0.5).validate()
    assert sample_rows(logits, [p], [None], [([1, 0], 1)]) == [1]  # output [0]: 2 - 0.5 < 1.9
    assert torch.equal(logits, raw)


def test_min_tokens_masks_the_end_tokens_until_enough_are_generated():
    """eos 3 and stop_token_ids (5,), min_tokens 2. One token generated: tokens 3 and 5 at
    -inf. Two generated: nothing masked. The count is of the output: a prompt of 4 tokens
    does not count (a mask counted over prompt and output would be off at the first step)."""
    logits = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    p = SamplingParams(min_tokens=2, stop_token_ids=(5,)).validate()
    (row,) = adjusted(logits, [p], [([9, 9, 9, 9, 0], 4)], eos_ids=frozenset({3}))
    assert row == [0.0, 1.0, 2.0, float("-inf"), 4.0, float("-inf")]
    assert sample_rows(torch.tensor(logits), [p], [None], [([9, 9, 9, 9, 0], 4)], frozenset({3})) == [4]
    (row,) = adjusted(logits, [p], [([9, 9, 9, 9, 0, 1], 4)], eos_ids=frozenset({3}))
    assert row == logits[0]


def test_a_row_with_every_token_masked_fails_alone():
    """min_tokens with every token a stop token: that row gets a sentence, its neighbour a token."""
    p = SamplingParams(min_tokens=1, stop_token_ids=(0, 1, 2)).validate()
    got = sample_rows(
        torch.tensor([[1.0, 2.0, 0.0]] * 2), [p, SamplingParams()], [None, None], [([0], 1)] * 2
    )
    assert isinstance(got[0], str) and "masked" in got[0] and got[1] == 1


def test_min_p_is_applied_after_temperature():
    """probs [0.5, 0.3, 0.15, 0.05], min_p 0.4. At temperature 1 a token stays when p >= 0.4 *
    0.5 = 0.2: tokens 0 and 1. At temperature 2 the probabilities go as sqrt(p), so a token
    stays when sqrt(p / 0.5) >= 0.4, p >= 0.08: tokens 0, 1 and 2 (min_p before temperature
    would keep two)."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.isfinite(filter_logits(logits, 0, 1.0, 0.4)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits / 2, 0, 1.0, 0.4)).tolist() == [True, True, True, False]
    got = filter_batch(torch.stack([logits, logits / 2]), [0, 0], [1.0, 1.0], [0.4, 0.4])
    assert torch.isfinite(got).tolist() == [[True, True, False, False], [True, True, True, False]]
    for temperature, allowed in ((1.0, {0, 1}), (2.0, {0, 1, 2})):
        p = SamplingParams(temperature=temperature, min_p=0.4, seed=1).validate()
        g = p.make_generator()
        drawn = {int(sample(logits[None], [p], [g])[0]) for _ in range(300)}
        assert drawn == allowed, (temperature, drawn)


def test_min_p_comes_before_top_p():
    """vLLM v1's order (min-p is a logits processor run before its top-k/top-p sampler). probs
    [0.4, 0.3, 0.2, 0.1], min_p 0.5 keeps p >= 0.2: [4/9, 3/9, 2/9] renormalized; top_p 0.75
    then keeps the first two (4/9 < 0.75 <= 7/9). Top-p first would keep three (0.7 < 0.75)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert torch.isfinite(filter_logits(logits, 0, 0.75, 0.5)).tolist() == [True, True, False, False]
    got = filter_batch(logits[None], [0], [0.75], [0.5])
    assert torch.isfinite(got[0]).tolist() == [True, True, False, False]


def test_the_batched_min_p_keeps_what_the_one_row_filter_keeps():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 64, generator=g) * 3).round()
    ks, ps, ms = [0, 5, 0, 20, 0, 3], [1.0, 1.0, 0.9, 0.5, 1.0, 0.7], [0.1, 0.0, 0.3, 0.05, 1.0, 0.2]
    got = filter_batch(logits, ks, ps, ms)
    for i in range(6):
        assert torch.equal(
            torch.isfinite(got[i]), torch.isfinite(filter_logits(logits[i], ks[i], ps[i], ms[i]))
        )


# --- batched, and the neutral path --------------------------------------------------------------


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_penalized_row_leaves_its_neighbours_tokens_and_logits_alone():
    """Four rows, one with every adjustment: the other three (greedy, seeded top-k, seeded
    top-p) draw what they draw without it, over several steps, and adjust_logits copies their
    logits bit for bit."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    plain = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_k=30, seed=4),
        SamplingParams(temperature=1.1, top_p=0.8, seed=5),
    ]
    heavy = SamplingParams(
        temperature=0.7, seed=6, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
        min_p=0.05, logit_bias={7: 3.0}, min_tokens=5, stop_token_ids=(11,),
    ).validate()  # fmt: skip
    history = [([1, 2, 3], 3), ([1, 2, 3, 50], 3), ([4, 4], 1), ([7, 8, 8, 9], 2)]
    alone_g = [None] + [p.make_generator() for p in plain[1:]]
    mixed_g = [None] + [p.make_generator() for p in plain[1:]] + [heavy.make_generator()]
    for _ in range(5):
        alone = sample_rows(logits[:3], plain, alone_g)
        mixed = sample_rows(logits, [*plain, heavy], mixed_g, history, frozenset({2}))
        assert mixed[:3] == alone and isinstance(mixed[3], int)
    out = adjust_logits(logits, [*plain, heavy], [3], history, frozenset({2}))
    assert torch.equal(out[:3], logits[:3]) and not torch.equal(out[3], logits[3])


def test_neutral_values_run_no_op_of_the_penalty_pass(monkeypatch):
    """Every option at its neutral value runs exactly the ops of the default params: the same
    op list, no scatter_add (the counting op), and adjust_logits is never entered (planted to raise)."""
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(1))
    neutral = dict(
        presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1.0, min_p=0.0,
        logit_bias={}, stop_token_ids=(), min_tokens=0, include_stop_str_in_output=False,
    )  # fmt: skip

    def ops(**kw):
        ps = [
            SamplingParams(**kw),
            SamplingParams(temperature=0.8, seed=2, **kw),
            SamplingParams(top_p=0.9, temperature=1.0, seed=3, **kw),
        ]
        with Ops() as c:
            tokens = sample_rows(logits, ps, [None, ps[1].make_generator(), ps[2].make_generator()])
        return c.ops, tokens

    def planted(*args, **kwargs):
        raise AssertionError("the penalty pass ran for neutral params")

    default = ops()
    monkeypatch.setattr(sampling, "adjust_logits", planted)
    assert ops(**neutral) == default
    assert not any("scatter_add" in op for op in default[0])
    monkeypatch.undo()
    with Ops() as c:  # and a penalized row does run them
        sample_rows(logits[:1], [SamplingParams(frequency_penalty=0.5)], [None], [([1, 2], 1)])
    assert any("scatter_add" in op for op in c.ops)


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=300, max_tokens=256), "min_tokens"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(stop_token_ids=(True,)), "stop_token_ids"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={-5: 1.0}), "logit_bias"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    ],
)
def test_each_option_out_of_range_is_a_sentence_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**kwargs).validate()
    assert e.value.param == field


def test_the_vocabulary_bounds_the_token_ids():
    SamplingParams(logit_bias={255: 1.0}, stop_token_ids=(255,)).validate(vocab=256)
    with pytest.raises(ValueError, match="logit_bias") as e:
        SamplingParams(logit_bias={256: 1.0}).validate(vocab=256)
    assert e.value.param == "logit_bias"
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(256,)).validate(vocab=256)


def test_the_edges_of_each_range_are_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, min_p=1.0).validate()
    SamplingParams(logit_bias={0: -100, 1: 100}, min_tokens=256, max_tokens=256).validate()


# --- through the engine ---------------------------------------------------------------------------


class LetterTokenizer:
    """A tokenizer for the tiny model: token t is the letter chr(97 + t % 26), the end token a
    special token with no text. Enough for the engine's text, stop strings and the chat route."""

    max_token_chars = 1

    def __init__(self, eos: int):
        self.eos_ids = self.special_ids = frozenset({eos})

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if skip_special_tokens and i in self.special_ids else chr(97 + i % 26) for i in ids)

    def encode(self, text, add_bos=None):
        return [ord(c) - 97 for c in text if "a" <= c <= "z"] or [0]

    def encode_chat(self, messages):
        return self.encode(" ".join(m["content"] or "" for m in messages))

    def detokenizer(self, skip_special_tokens=True):
        return IncrementalDetokenizer(self, skip_special_tokens)


PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-penalties")
    make_tiny_dir(path, seed=3)
    return ours_from_dir(path)


def engine_on(model, tokenizer=None, max_batch=4):
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    return Engine(model, tokenizer, EngineConfig(max_batch=max_batch, kv_budget=per_block * 64))


def run(engine, params, prompt=PROMPT):
    (c,) = engine.generate([prompt], params, use_tqdm=False)
    return c


def plain_greedy(model, n=24, prompt=PROMPT):
    return run(engine_on(model), SamplingParams(max_tokens=n, ignore_eos=True), prompt).token_ids


NEUTRAL = [
    dict(presence_penalty=0.0),
    dict(frequency_penalty=0.0),
    dict(repetition_penalty=1.0),
    dict(min_p=0.0),
    dict(logit_bias={}),
    dict(logit_bias={87: 0.0, 3: 0.0}),  # through the penalty pass, adding zeros
    dict(stop_token_ids=[]),
    dict(min_tokens=0),
    dict(min_tokens=3),  # through the penalty pass: no end token to mask on this engine
    dict(include_stop_str_in_output=True),  # no stop string: nothing to keep
]


@pytest.mark.parametrize("option", NEUTRAL, ids=[str(o) for o in NEUTRAL])
def test_each_option_at_its_neutral_value_gives_the_unset_tokens(tiny_model, option):
    """Greedy and seeded sampled, 16 tokens each, against the same request without the option."""
    engine = engine_on(tiny_model)
    for base in (dict(), dict(temperature=0.9, top_p=0.95, seed=11)):
        want = run(engine, SamplingParams(max_tokens=16, **base)).token_ids
        got = run(engine, SamplingParams(max_tokens=16, **base, **option)).token_ids
        assert got == want, (base, option)


def reference_penalized(model, prompt, n, rep=1.0, freq=0.0, pres=0.0, count_prompt=False):
    """Greedy tokens under the penalties, by the definitions, one position at a time: the raw
    logits of the whole prefix (the contiguous-cache forward pass), then plain Python loops
    over the tokens seen. count_prompt: the wrong build, the prompt counted by f and p too."""
    ids, out = list(prompt), []
    for _ in range(n):
        x = prefill_logits(model, ids)[-1].double().numpy().copy()
        for t in set(ids):  # repetition: prompt and output
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t, c in Counter(ids if count_prompt else out).items():
            x[t] -= freq * c + pres
        token = int(np.argmax(x))
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize(
    "penalties",
    [dict(freq=0.05), dict(pres=0.08), dict(rep=1.3), dict(rep=1.1, freq=0.03, pres=0.02)],
    ids=["frequency", "presence", "repetition", "all three"],
)
def test_the_engine_penalizes_what_each_sequence_has_seen(tiny_model, penalties):
    """The engine's greedy tokens under each penalty equal the reference's. The prompt holds
    tokens the plain continuation picks, so a frequency or presence penalty built over the
    prompt too (or a repetition penalty over the output alone) picks otherwise: each case also
    checks that the wrong build does differ here, so the test has teeth."""
    plain = plain_greedy(tiny_model, 8)
    prompt = PROMPT + plain[:3]
    n = 16
    want = reference_penalized(tiny_model, prompt, n, **penalties)
    params = SamplingParams(
        max_tokens=n,
        repetition_penalty=penalties.get("rep", 1.0),
        frequency_penalty=penalties.get("freq", 0.0),
        presence_penalty=penalties.get("pres", 0.0),
    )
    got = run(engine_on(tiny_model), params, prompt).token_ids
    assert got == want
    if "rep" in penalties:  # repetition over the output only: the prompt dropped from `set(ids)`
        wrong = reference_wrong_repetition(tiny_model, prompt, n, **penalties)
    else:
        wrong = reference_penalized(tiny_model, prompt, n, **penalties, count_prompt=True)
    assert wrong != want


def reference_wrong_repetition(model, prompt, n, rep=1.0, freq=0.0, pres=0.0):
    """The wrong build of a repetition penalty: over the generated tokens only."""
    ids, out = list(prompt), []
    for _ in range(n):
        x = prefill_logits(model, ids)[-1].double().numpy().copy()
        for t in set(out):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t, c in Counter(out).items():
            x[t] -= freq * c + pres
        token = int(np.argmax(x))
        ids.append(token)
        out.append(token)
    return out


def test_penalized_and_plain_requests_batched_together(tiny_model):
    """Three requests in one batch (greedy, seeded sampled, penalized greedy): the first two get
    the tokens they get alone, the third what it gets alone."""
    engine = engine_on(tiny_model)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=21)
    penalized = SamplingParams(
        max_tokens=16, frequency_penalty=0.1, presence_penalty=0.05, repetition_penalty=1.2
    )
    prompts = [PROMPT, [3, 3, 3, 3], [100, 7, 7, 200, 31]]
    alone = [run(engine, p, q).token_ids for p, q in zip((greedy, sampled, penalized), prompts)]
    together = engine.generate(prompts, [greedy, sampled, penalized], use_tqdm=False)
    assert [c.token_ids for c in together] == alone
    assert alone[2] != run(engine, SamplingParams(max_tokens=16), prompts[2]).token_ids  # it did act


def test_stop_token_ids_end_the_sequence(tiny_model):
    """The plain greedy tokens G; stop_token_ids [G[k]] (its first occurrence at k) ends the
    output at G[:k + 1], finish "stop", on an engine without a tokenizer or any end token."""
    g = plain_greedy(tiny_model)
    k = next(i for i in range(3, len(g)) if g[i] not in g[:i])
    c = run(engine_on(tiny_model), SamplingParams(max_tokens=24, stop_token_ids=[g[k]]))
    assert c.token_ids == g[: k + 1] and c.finish_reason == "stop"
    c = run(engine_on(tiny_model), SamplingParams(max_tokens=24, stop_token_ids=[999 % 256, g[k]]))
    assert c.finish_reason == "stop" and c.token_ids[-1] in (999 % 256, g[k])


def test_min_tokens_holds_off_a_stop_token(tiny_model):
    """stop_token_ids [G[k]] with min_tokens k + 2: G[k] is masked for the first k + 2 tokens,
    so the first k tokens are G's, token k is the best other than G[k] (by hand: the raw
    logits' argmax with it at -inf), and G[k] appears nowhere in the first k + 2."""
    g = plain_greedy(tiny_model)
    k = next(i for i in range(3, len(g)) if g[i] not in g[:i])
    c = run(engine_on(tiny_model), SamplingParams(max_tokens=24, stop_token_ids=[g[k]], min_tokens=k + 2))
    x = prefill_logits(tiny_model, PROMPT + g[:k])[-1].clone()
    x[g[k]] = float("-inf")
    assert c.token_ids[:k] == g[:k] and c.token_ids[k] == int(x.argmax())
    assert g[k] not in c.token_ids[: k + 2]
    if g[k] in c.token_ids:  # after min_tokens it stops as before
        assert c.finish_reason == "stop" and c.token_ids.index(g[k]) == len(c.token_ids) - 1


def test_min_tokens_holds_off_the_end_token(tiny_model):
    """An engine whose end token is G[k]: without min_tokens it stops there (the end token's
    text is not shown); with min_tokens k + 2 the end token is masked, as vLLM masks it, and the
    output runs on past k."""
    g = plain_greedy(tiny_model)
    k = next(i for i in range(3, len(g)) if g[i] not in g[:i])
    engine = engine_on(tiny_model, LetterTokenizer(eos=g[k]))
    c = run(engine, SamplingParams(max_tokens=24))
    assert c.token_ids == g[: k + 1] and c.finish_reason == "stop" and len(c.text) == k
    c = run(engine, SamplingParams(max_tokens=24, min_tokens=k + 2))
    assert c.token_ids[:k] == g[:k] and g[k] not in c.token_ids[: k + 2] and len(c.token_ids) > k + 2


def letters(ids):
    return "".join(chr(97 + i % 26) for i in ids)


def test_stop_strings_and_include_stop_str_in_output(tiny_model):
    """The plain greedy text T (one letter a token). A stop string s first complete at
    character e: the text is T[:e - len(s)] without include_stop_str_in_output, T[:e] with it."""
    g = plain_greedy(tiny_model)
    engine = engine_on(tiny_model, LetterTokenizer(eos=255))
    text = letters(g)
    stop = text[5:7]
    start = text.find(stop)
    c = run(engine, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    assert c.text == text[:start] and c.finish_reason == "stop"
    c = run(
        engine, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    )
    assert c.text == text[: start + 2] and c.finish_reason == "stop"


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(tiny_model):
    """stop_token_ids [G[k]], a token with text: its letter is dropped by default (vLLM leaves
    the stop token out of the text), kept with include_stop_str_in_output."""
    g = plain_greedy(tiny_model)
    k = next(i for i in range(3, len(g)) if g[i] not in g[:i])
    engine = engine_on(tiny_model, LetterTokenizer(eos=255))
    c = run(engine, SamplingParams(max_tokens=24, stop_token_ids=[g[k]]))
    assert c.text == letters(g[:k])
    c = run(engine, SamplingParams(max_tokens=24, stop_token_ids=[g[k]], include_stop_str_in_output=True))
    assert c.text == letters(g[: k + 1])


def test_min_tokens_lets_a_stop_string_inside_them_pass(tiny_model):
    """A one-letter stop string whose first occurrence is token a and next is token b > a: with
    min_tokens a + 1, the first is ordinary text (it completes within the first min_tokens
    tokens) and the text is cut at b; with min_tokens a it is cut at a. An engine that counted
    min_tokens over the prompt (4 tokens) would cut at a both times."""
    g = plain_greedy(tiny_model, 32)
    text = letters(g)
    a = next(i for i in range(2, len(text)) if text[i] not in text[:i] and text[i] in text[i + 1 :])
    b = text.index(text[a], a + 1)
    engine = engine_on(tiny_model, LetterTokenizer(eos=255))
    base = dict(max_tokens=32, ignore_eos=True, stop=[text[a]])
    assert run(engine, SamplingParams(**base, min_tokens=a)).text == text[:a]
    c = run(engine, SamplingParams(**base, min_tokens=a + 1))
    assert c.text == text[:b] and c.finish_reason == "stop"


# --- through the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = engine_on(tiny_model, LetterTokenizer(eos=255))
    with ServerThread(create_app(engine)) as url:
        yield url, engine


CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
COMP = {"prompt": PROMPT, "max_tokens": 4}
OUT_OF_RANGE = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.5}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens 4
    ({"stop_token_ids": [256]}, "stop_token_ids"),  # past the tiny vocabulary of 256
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"256": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"presence_penalty": "0.5"}, "presence_penalty"),  # the schema's strict types
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, field", OUT_OF_RANGE, ids=[f for _, f in OUT_OF_RANGE])
def test_out_of_range_is_a_400_naming_the_field(server, route, extra, field):
    url, engine = server
    body = (CHAT if "chat" in route else COMP) | extra
    steps = engine.step_kinds.copy()
    r = httpx.post(url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert engine.step_kinds == steps  # refused at the door


def test_every_field_is_accepted_on_both_routes(server):
    url, _ = server
    fields = dict(
        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, min_p=0.05,
        logit_bias={"3": 2.5}, stop_token_ids=[7], min_tokens=2, include_stop_str_in_output=True,
        temperature=0,
    )  # fmt: skip
    for route, body in (("/v1/completions", COMP), ("/v1/chat/completions", CHAT)):
        r = httpx.post(url + route, json=body | fields, timeout=30)
        assert r.status_code == 200, (route, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 2


def test_a_logit_bias_reaches_the_sampler(server):
    """A bias of 100 on token 3 makes it the greedy choice at every step; the same request
    without it does not pick it every time."""
    url, _ = server
    body = COMP | {"temperature": 0, "return_token_ids": True}
    biased = httpx.post(url + "/v1/completions", json=body | {"logit_bias": {"3": 100}}, timeout=30).json()
    plain = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
    assert biased["choices"][0]["token_ids"] == [3, 3, 3, 3]
    assert plain["choices"][0]["token_ids"] != [3, 3, 3, 3]


def test_null_user_content_is_a_400_and_null_assistant_content_is_not(server):
    url, _ = server
    for role in ("user", "system"):
        body = {"messages": [{"role": role, "content": None}], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text
    body = {"messages": [{"role": "user"}], "max_tokens": 2}  # absent is null
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    body = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 2,
    }
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


# --- the real model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_engine(smollm_dir):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    return Engine(
        load_model(smollm_dir), Tokenizer.from_dir(smollm_dir), EngineConfig(max_batch=2, max_model_len=512)
    )


def test_frequency_penalty_breaks_a_repetitive_greedy_continuation_on_smollm(smollm_engine):
    """SmolLM2's greedy continuation of a repetitive prompt repeats; frequency_penalty 0 gives
    the same tokens as no penalty, and 1.0 gives other tokens, with fewer repeats of its most
    repeated token."""
    prompt = "apple apple apple apple apple apple apple apple"
    n = 24

    def tokens(**kw):
        return run(smollm_engine, SamplingParams(max_tokens=n, ignore_eos=True, **kw), prompt).token_ids

    plain, zero, penalized = tokens(), tokens(frequency_penalty=0.0), tokens(frequency_penalty=1.0)
    most, most_penalized = Counter(plain).most_common(1)[0][1], Counter(penalized).most_common(1)[0][1]
    print(f"plain: the most repeated token {most} times of {n}; penalized: {most_penalized}")
    assert zero == plain
    assert penalized != plain
    assert most_penalized < most
