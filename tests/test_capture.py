"""HostGraph: live storage, frozen values, and a refusal when storage moves."""

from dataclasses import dataclass

import pytest
import torch

from nanoserve.capture import HostGraph, ReplayError


def test_replay_reads_live_storage_but_frozen_values():
    buf = torch.zeros(3)
    g = HostGraph.record(lambda x, k: x * k, buf, 2)
    buf.copy_(torch.tensor([1.0, 2.0, 3.0]))
    out = g.replay()
    assert out.tolist() == [2.0, 4.0, 6.0]
    assert g.replay() is out  # one output buffer, overwritten in place, like a CUDA graph's


@dataclass
class Plan:
    ids: torch.Tensor
    rows: tuple


def test_a_plan_keeps_its_tensors_bound_and_its_rows_frozen():
    plan = Plan(torch.tensor([0, 1]), rows=("a", "b"))
    seen = []

    def step(p):
        seen.append(p.rows)
        return p.ids.float() + 1

    g = HostGraph.record(step, plan)
    plan.ids.copy_(torch.tensor([5, 6]))
    plan.rows = ("c",)  # a later step over other sequences: the graph cannot know
    assert g.replay().tolist() == [6.0, 7.0]
    assert seen[-1] == ("a", "b")  # the stale frozen value: exactly the day-54 hazard


def test_a_list_argument_is_frozen_by_value():
    lengths = [1, 2]
    g = HostGraph.record(lambda t, n: t + sum(n), torch.zeros(1), lengths)
    lengths.append(10)
    assert g.replay().item() == 3.0


def test_replay_refuses_when_storage_moved():
    buf = torch.zeros(4)
    g = HostGraph.record(lambda x: x + 1, buf)
    buf.set_(torch.zeros(8))  # same tensor object, new storage
    with pytest.raises(ReplayError, match="moved"):
        g.replay()
