"""Run by every rank of a tensor-parallel test (tests/test_tp.py), and in one process for the
reference: `python -m tests.tp_ranks SPEC.json`. SPEC: {"config": EngineConfig fields,
"requests": [[prompt ids, max_tokens], ...], "stagger": k, "out": path}. Rank 0 (or the single
process) runs the requests through `build_engine`'s engine and writes what came out to `out`;
any other rank follows rank 0's steps (nanoserve.tp.run_worker)."""

from __future__ import annotations

import json
import sys

from nanoserve.config import EngineConfig
from nanoserve.engine import build_engine
from nanoserve.sampling import SamplingParams
from nanoserve.tp import launched, run_worker


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


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    config = EngineConfig(**spec["config"])
    where = launched()
    if where is not None and where[0] != 0:
        run_worker(config)
        return
    out = run(build_engine(config), spec["requests"], spec.get("stagger", 0))
    with open(spec["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
