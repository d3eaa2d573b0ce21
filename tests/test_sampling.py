"""The sampler: greedy, temperature, top-k, top-p, min-p, seeds, and bad parameters (the
penalties, logit_bias and the min_tokens mask: tests/test_penalties.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.sampling import SamplingParams, filter_logits, sample


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    p = SamplingParams()
    assert sample(logits.clone(), [p, p], [None, None]).tolist() == [1, 0]


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=0.8))
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=0.81))
    assert kept.tolist() == [True, True, True, False]
    kept = torch.isfinite(filter_logits(probs.log(), top_k=0, top_p=0.01))
    assert kept.tolist() == [True, False, False, False]  # the top token always stays


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.3, 2.0), st.integers(0, 20), st.floats(0.05, 1.0))
def test_sampled_tokens_stay_inside_the_filter(seed, temperature, top_k, top_p):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(seed)) * 3
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed).validate()
    allowed = torch.isfinite(filter_logits(logits / temperature, top_k, top_p))
    g = p.make_generator()
    for _ in range(5):
        tok = sample(logits[None].clone(), [p], [g])[0]
        assert allowed[tok]


def test_a_seeded_row_does_not_depend_on_its_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[:1].clone(), [seeded], [g])[0].item() for g in [seeded.make_generator()] * 1]
    other = SamplingParams(temperature=0.7, seed=99)
    g_seeded, g_other = seeded.make_generator(), other.make_generator()
    batch = sample(logits[[0, 1]].clone(), [seeded, other], [g_seeded, g_other])
    assert batch[0].item() == alone[0]
    # and a different seed does draw differently somewhere over a few draws
    g1, g2 = seeded.make_generator(), SamplingParams(temperature=1.0, seed=4321).make_generator()
    draws1 = [sample(logits[:1].clone(), [seeded], [g1])[0].item() for _ in range(10)]
    draws2 = [sample(logits[:1].clone(), [seeded], [g2])[0].item() for _ in range(10)]
    assert draws1 != draws2


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop=("",)), "stop"),
        (dict(seed="x"), "seed"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(min_p=2.0), "min_p"),
    ],
)
def test_bad_params_are_a_sentence(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        SamplingParams(**kwargs).validate()
    assert e.value.param == words  # the field the server's 400 names


def test_good_params_pass_and_a_single_stop_string_becomes_a_tuple():
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, stop="END", seed=1).validate()
    assert p.stop == ("END",)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.lists(
        st.tuples(
            st.integers(0, 70),
            st.sampled_from([1.0, 0.9, 0.5, 0.05, 1e-9]),
            st.sampled_from([0.0, 0.0, 0.02, 0.3, 1.0]),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_the_batched_filter_keeps_what_the_one_row_filter_keeps(seed, settings_):
    """filter_batch against filter_logits, row by row, each row under its own min-p, top-k and
    top-p; ties are made on purpose (rounded logits), where an order-dependent filter would
    differ."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(len(settings_), 64, generator=g) * 3).round()
    ks, ps, ms = ([s[j] for s in settings_] for j in range(3))
    from nanoserve.sampling import filter_batch

    got = filter_batch(logits, ks, ps, ms)
    for i, (k, p, m) in enumerate(settings_):
        want = filter_logits(logits[i], k, p, m)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), (k, p, m)


def test_the_batched_filter_check_fails_on_a_shared_k():
    """The check above, shown failing: a filter that used the batch's first k for every row."""
    from nanoserve.sampling import filter_batch

    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    wrong = filter_batch(logits, [3, 3], [1.0, 1.0])
    assert not torch.equal(torch.isfinite(wrong[1]), torch.isfinite(filter_logits(logits[1], 10, 1.0)))


def test_a_seeded_row_draws_the_same_alone_and_in_a_mixed_batch():
    """The batched sampler: a seeded row's token, over several draws, is the same alone and
    beside greedy, top-k and top-p rows."""
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=77)
    others = [
        SamplingParams(),
        SamplingParams(temperature=1.2, top_k=5, seed=1),
        SamplingParams(top_p=0.5, temperature=1.0, seed=2),
    ]
    g_alone, g_batch = seeded.make_generator(), seeded.make_generator()
    gens = [None] + [p.make_generator() for p in others[1:]]
    for _ in range(8):
        alone = sample(logits[:1].clone(), [seeded], [g_alone])[0].item()
        batch = sample(logits.clone(), [seeded, *others], [g_batch, *gens])
        assert batch[0].item() == alone


def test_a_nucleus_wider_than_the_candidates_is_found_by_sorting_that_row():
    """`nucleus_floor` looks among the top NUCLEUS_CANDIDATES logits first; a flat row whose
    nucleus holds more tokens than that is sorted whole, and keeps what `filter_logits` keeps.
    The flat row below keeps more than 1,024 tokens, which the candidates alone cannot give."""
    from nanoserve.sampling import NUCLEUS_CANDIDATES, filter_batch

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 8000, generator=g) * torch.tensor([[0.01], [4.0], [1.0]])
    got = filter_batch(logits, [0, 0, 50], [0.9, 0.9, 0.5])
    kept = [int(torch.isfinite(row).sum()) for row in got]
    for i, (k, p) in enumerate([(0, 0.9), (0, 0.9), (50, 0.5)]):
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(filter_logits(logits[i], k, p)))
    assert kept[0] > NUCLEUS_CANDIDATES > kept[1] >= 1
