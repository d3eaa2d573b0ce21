"""Graphs, in principle (day 50): what a recorded step binds and what it freezes.

A CUDA graph replays the kernels it recorded against the addresses it recorded them with, and
every Python value it saw while recording is baked in. `HostGraph` is the CPU stand-in with the
same contract, so the arc of days 50-56 runs and is tested without a GPU:

* recording runs the step once and keeps its tensor arguments by identity (their storage is
  live: new numbers written into them are what a replay computes on), and everything else by
  value (frozen: a later change to a Python list, tuple field or int is not seen);
* replay re-runs the step on exactly those objects, writes the result into the output it
  returned at recording (a CUDA graph's output is a fixed buffer too), and refuses with
  `ReplayError` if any bound tensor's storage moved (`data_ptr` changed).

So a replay over a stale frozen value computes the wrong thing on CPU exactly as it would on
CUDA; that is what the day-54 gates are for. Objects (a plan dataclass, say) are copied one
level at a time: their tensor fields stay bound, their other fields are frozen.

    buf = torch.zeros(3); g = HostGraph.record(lambda x, k: x * k, buf, 2)
    buf.copy_(torch.tensor([1., 2., 3.])); g.replay()   -> tensor([2., 4., 6.])   live storage
    (the 2 was frozen: nothing can make this graph multiply by 3)
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from nanoserve.errors import GateError


class ReplayError(RuntimeError):
    """A bound tensor's storage moved since recording: a real graph would read freed memory."""


def freeze(value, bound: list | None = None):
    """Tensors by identity (and appended to `bound`, the ones a replay reads by address);
    containers and dataclasses rebuilt around frozen members; the rest deep-copied, so later
    mutation cannot reach the recorded call."""
    if isinstance(value, torch.Tensor):
        if bound is not None:
            bound.append(value)
        return value
    if isinstance(value, (list, tuple)):
        items = [freeze(v, bound) for v in value]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        return {k: freeze(v, bound) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        clone = copy.copy(value)
        for f in dataclasses.fields(value):
            object.__setattr__(clone, f.name, freeze(getattr(value, f.name), bound))
        return clone
    return copy.deepcopy(value)


class HostGraph:
    def __init__(self, fn, args, kwargs, output, bound: list[torch.Tensor]):
        self.fn, self.args, self.kwargs, self.output = fn, args, kwargs, output
        self.bound = bound
        self.addresses = [t.data_ptr() for t in bound]

    @classmethod
    def record(cls, fn, *args, **kwargs) -> HostGraph:
        bound: list[torch.Tensor] = []
        args, kwargs = freeze(args, bound), freeze(kwargs, bound)
        return cls(fn, args, kwargs, fn(*args, **kwargs), bound)

    def check_addresses(self) -> None:
        for t, addr in zip(self.bound, self.addresses):
            if t.data_ptr() != addr:
                raise ReplayError(
                    f"a bound tensor of shape {tuple(t.shape)} moved from {addr:#x} to {t.data_ptr():#x} "
                    "since recording; record the graph again"
                )

    def replay(self):
        self.check_addresses()
        out = self.fn(*self.args, **self.kwargs)
        if isinstance(self.output, torch.Tensor):
            self.output.copy_(out)
            return self.output
        return out


class CudaGraph:
    """`torch.cuda.CUDAGraph` around one step, with `HostGraph`'s interface. Every capture of a
    runner shares one memory pool (`pool`, from `torch.cuda.graph_pool_handle()`), so the list
    costs what its largest member costs when recorded biggest first. Not exercised on CPU: the
    CUDA tests skip with a reason where no GPU is present."""

    def __init__(self, fn, args, kwargs, graph, output):
        self.fn, self.args, self.kwargs, self.graph, self.output = fn, args, kwargs, graph, output

    @classmethod
    def record(cls, fn, *args, pool=None, **kwargs) -> CudaGraph:
        args, kwargs = freeze(args), freeze(kwargs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one eager run first: kernels chosen, workspaces allocated
            fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = fn(*args, **kwargs)
        return cls(fn, args, kwargs, graph, output)

    def replay(self):
        self.graph.replay()
        return self.output


def check_addresses_stable(inputs, recorded: tuple[int, ...]) -> None:
    """The persistent buffers a graph reads are where they were when it was recorded."""
    now = inputs.addresses
    if now != tuple(recorded):
        moved = [i for i, (a, b) in enumerate(zip(now, recorded)) if a != b]
        raise GateError(
            f"persistent input buffers {moved} moved since recording ({len(moved)} of {len(now)})"
        )


def check_replay_rows(graph: HostGraph | CudaGraph, plan) -> None:
    """A graph's frozen row tuple is empty (recorded on a warm batch) or this step's rows: a
    mid-run capture replayed over another set of sequences has frozen the wrong ones."""
    name = lambda s: getattr(s, "request_id", s)  # noqa: E731  (frozen rows are copies: compare names)
    frozen = [name(s) for s in (graph.args[0].rows if graph.args else ())]
    now = [name(s) for s in plan.rows]
    if frozen and frozen != now:
        raise GateError(
            f"this graph froze rows {frozen} at recording; replaying it for {now} "
            "replays another batch's plan"
        )


def pool_sharing_ratio(member_bytes: list[int]) -> float:
    """What separate pools would cost over what one shared pool costs. A shared pool is as large
    as its largest member (captures replay one at a time), so the ratio is sum / max: 576
    captures of similar size share at close to 576x, a list dominated by one shape near 1x."""
    return sum(member_bytes) / max(member_bytes) if member_bytes else 1.0


def check_pool_budget(pool_bytes: int, budget_bytes: int) -> None:
    """The graphs' shared pool fits the memory still free once weights and KV pool are resident."""
    if pool_bytes > budget_bytes:
        raise GateError(
            f"the graph pool needs {pool_bytes:,} bytes but only {budget_bytes:,} are free; "
            "trim the warm list's widest shape (warm_shapes(max_width=width_ceiling(...)))"
        )
