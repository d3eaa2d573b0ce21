"""Run by every rank of a tensor-parallel test (tests/test_tp.py), and in one process for the
reference: `python -m tests.tp_ranks SPEC.json`. SPEC: {"config": EngineConfig fields,
"requests": [[prompt ids, max_tokens], ...], "stagger": k, "out": path}. Rank 0 (or the single
process) runs the requests through `build_engine`'s engine and writes what came out to `out`;
any other rank follows rank 0's steps (nanoserve.tp.run_worker) and, if that fails, says why in
one line as the CLI does and exits 1.

Two more keys, for rank 0: "no_pickles": after the engine is built (setup is the last pickle),
`broadcast_object_list` raises, so a plan sent as a pickle ends the run; "fault_at": k plants
an error in rank 0's last block at its k-th call (mid-forward, after the plan has left), serves
the requests through an `EngineLoop` instead and writes how they and the loop ended, then
stays alive until killed, so that the workers can only have stopped because rank 0 told them.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time

import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.engine import RequestOutput, build_engine
from nanoserve.errors import NanoserveError
from nanoserve.sampling import SamplingParams
from nanoserve.tp import launched, run_worker

PLANTED = "a fault planted in rank 0's last block"


def run(engine, requests, stagger: int = 0) -> dict:
    """Add the requests (all at once, or one every `stagger` steps), step to the end: each
    request's tokens and the log-probabilities of its top 5 at every step."""
    ids, tokens, scores = {}, {}, {}
    pending, steps = list(enumerate(requests)), 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or steps % stagger == 0):
            batch = pending if stagger == 0 else pending[:1]
            for i, (prompt, n) in batch:
                params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5)
                ids[engine.add_request(prompt, params)] = i
            pending = pending[len(batch) :]
        for o in engine.step():
            i = ids[o.request_id]
            tokens.setdefault(i, []).extend(o.new_token_ids)
            for lp in o.logprobs or []:
                scores.setdefault(i, []).append([[t, float(v)] for t, v in lp.top])
        steps += 1
    tp = getattr(engine.model, "tp", None)
    return {
        "tokens": [tokens[i] for i in range(len(requests))],
        "logprobs": [scores.get(i, []) for i in range(len(requests))],
        "preemptions": engine.scheduler.num_preemptions,
        "free_blocks": engine.allocator.num_free,
        "blocks": engine.allocator.num_blocks,
        "steps": steps,
        "collectives": tp.collectives if tp is not None else 0,
        "ranks": tp.world if tp is not None else 1,
        "shares": [s.__dict__ for s in tp.shares] if tp is not None else [],
    }


def run_with_fault(engine, requests, fault_at: int) -> dict:
    """The requests through an EngineLoop, rank 0's last block raising at its `fault_at`-th
    call: how each request ended (its Refused's status and message, or its finish reason) and
    why the loop stopped, if it did."""
    from nanoserve.loop import EngineLoop, Refused

    block, calls = engine.model.blocks[-1], 0
    forward = block.forward

    def faulty(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == fault_at:
            raise RuntimeError(PLANTED)
        return forward(*args, **kwargs)

    block.forward = faulty
    deaths: list[str] = []
    loop = EngineLoop(engine, on_death=deaths.append)
    loop.start()
    boxes = [queue.SimpleQueue() for _ in requests]
    for i, (prompt, n) in enumerate(requests):
        loop.submit(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True), boxes[i].put)
    ends = []
    for box in boxes:
        while True:
            item = box.get(timeout=300)
            if isinstance(item, Refused):
                ends.append([item.status, item.message])
                break
            if isinstance(item, RequestOutput) and item.finished:
                ends.append([200, item.finish_reason])
                break
    if loop.failure is not None:
        loop.thread.join(timeout=30)  # on_death comes after the requests are ended
    return {"ends": ends, "failure": loop.failure, "deaths": deaths, "alive": loop.alive, "calls": calls}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    config = EngineConfig(**spec["config"])
    where = launched()
    if where is not None and where[0] != 0:
        try:
            run_worker(config)
        except NanoserveError as e:
            print(f"nanoserve: error: {e}", file=sys.stderr)
            sys.exit(1)
        return
    engine = build_engine(config)
    if spec.get("no_pickles"):

        def refuse(*args, **kwargs):
            raise AssertionError("broadcast_object_list was called after setup: a plan went as a pickle")

        dist.broadcast_object_list = refuse
    if spec.get("fault_at"):
        out = run_with_fault(engine, spec["requests"], spec["fault_at"])
    else:
        out = run(engine, spec["requests"], spec.get("stagger", 0))
    with open(spec["out"] + ".part", "w") as f:
        json.dump(out, f)
    os.replace(spec["out"] + ".part", spec["out"])  # whole, for a reader that polls for it
    if spec.get("fault_at"):
        time.sleep(600)  # killed by the test once it has watched the workers


if __name__ == "__main__":
    main()
