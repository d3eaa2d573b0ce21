"""What the server says about itself (days 41, 45, 56): its state, `/health`'s body, the boot line.

    state = ServerState()          # phase: loading -> warming -> ready -> draining, or failed
    body, status = health(state)   # what GET /health answers
    boot_line(engine, "127.0.0.1:8000")

`ServerState` is the one object the routes, the request handlers and the lifecycle share: the
engine once built, its loop, the phase, and why it failed. The rest are plain functions of an
engine that turn its plans into dicts and one printed line, so a notebook can call them without
a server. Routes live in serve.py, the running of a request in handlers.py, shutdown in
lifecycle.py.
"""

from __future__ import annotations

import dataclasses
import time

from nanoserve.engine import Engine
from nanoserve.loop import EngineLoop
from nanoserve.models import describe_weights, weight_types
from nanoserve.quant import WEIGHTS


class ServerState:
    def __init__(self):
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.phase = "loading"  # loading | warming | ready | draining | failed
        self.error: str | None = None
        self.created = int(time.time())
        self.served_names: tuple[str, ...] = ()  # what a request's `model` may say; set when ready

    def fail(self, reason: str) -> None:
        self.phase, self.error = "failed", reason


def pool_dict(engine: Engine) -> dict:
    """The KV pool's plan; for a model whose sliding layers have their own blocks, also theirs
    (`window_group`) and what each group holds now."""
    plan = engine.pool
    out = dataclasses.asdict(plan) | {"num_slots": plan.num_slots, "describe": plan.describe()}
    if engine.window_pool is not None:
        w, blocks = engine.window_pool, engine.window_blocks
        out["window_group"] = dataclasses.asdict(w) | {
            "window": blocks.window,
            "layers": list(engine.model.cfg.sliding_layers),
            "blocks_used": blocks.num_used,
            "describe": w.describe(),
        }
        out["kv_bytes_held"] = engine.kv_bytes_held()
    return out


def paths_dict(engine: Engine) -> dict:
    """What the weights are and which way each part of a step runs (engine.paths_line)."""
    from nanoserve.models import model_weight_bytes

    model = engine.model
    quantized = model.weights in WEIGHTS
    return {
        "weights": model.weights,
        "activations": model.head.activations if quantized else model.weights,
        "weight_bytes": model_weight_bytes(model),
        "linears": engine.linear,
        "decode_step": engine.decode_step,
        # the fused step is one native call for any batch shape: nothing is compiled or recorded
        # per shape, so it adds nothing to the warm list
        "decode_step_setup_s": 0.0,
        "decode_attention": engine.cache.attention,
    }


def tp_dict(engine: Engine) -> dict:
    """Under tensor parallelism: the rank count and each rank's share (tp.py); else nothing."""
    tp = getattr(engine.model, "tp", None)
    return {} if tp is None else {"tensor_parallel": tp.as_dict()}


def warm_dict(engine: Engine) -> dict | None:
    """The warm plan as /health reports it, with what recorded graphs hold now."""
    runner = engine.runner
    if not runner.capture:
        return None
    report = engine.warm_report.as_dict() if engine.warm_report is not None else {}
    return report | {
        "recording": "lazy" if runner.lazy else "warm list only",
        "graphs_now": len(runner.graphs),
        "graph_bytes": runner.graph_bytes,
        "graph_budget_bytes": runner.graph_budget,
        "eager_steps": runner.eager_steps,
    }


def health(state: ServerState) -> tuple[dict, int]:
    """/health's body and status: 200 with the pool, the warm plan and the queue when ready;
    503 with the phase (and the reason, or what is still in flight while draining) otherwise."""
    eng = state.engine
    if state.phase != "ready":
        body = {"status": state.phase, "error": state.error}
        if state.phase == "draining" and state.loop is not None:
            body["in_flight"] = state.loop.in_flight
        return body, 503
    body = {
        "status": "ok",
        "model": eng.model_name,
        "served_model_names": list(state.served_names),
        "family": eng.model.cfg.family,
        "weight_types": weight_types(eng.model),
        "max_model_len": eng.max_model_len,
        "pool": pool_dict(eng),
        "warm": warm_dict(eng),
        "paths": paths_dict(eng),
        "running": len(eng.scheduler.running),
        "waiting": len(eng.scheduler.waiting),
        "kv_blocks_used": eng.allocator.num_used,
    }
    if eng.proposer is not None:  # speculative decoding: what it proposed and kept so far
        body["speculative"] = {"method": "ngram", "k": eng.proposer.k} | eng.spec_stats.as_dict()
    return body | tp_dict(eng), 200


def boot_line(engine: Engine, address: str | None = None) -> str:
    """One line: model, dtype, device, pool, warm list, and where it listens."""
    p, w = engine.pool, engine.warm_report
    warm = f"{w.graphs} graphs in {w.seconds:.2f} s, {w.bytes / 1e6:.1f} MB" if w else "none"
    where = f" · listening on http://{address}" if address else ""
    if engine.model.weights in WEIGHTS or engine.decode_step == "fused":
        # the fused step has no per-shape setup (nothing compiled or recorded): 0 s at boot
        where = f" · weights {describe_weights(engine.model)} · decode step {engine.decode_step}" + where
    if engine.proposer is not None:
        where = f" · {engine.proposer.describe()}" + where
    tp = getattr(engine.model, "tp", None)
    if tp is not None:
        where = f" · tensor parallel {tp.world} ranks ({tp.backend})" + where
    pool_mb = p.num_blocks * p.bytes_per_block / 1e6
    family = engine.model.cfg.family
    name = engine.model_name if family == "llama" else f"{engine.model_name} ({family})"
    pool = f"{p.num_blocks} blocks x {p.block_size} = {p.num_slots:,} tokens, {pool_mb:.1f} MB"
    if engine.window_pool is not None:  # two groups: the full layers', the sliding layers'
        g = engine.window_pool
        g_mb = g.num_blocks * g.bytes_per_block / 1e6
        pool = (
            f"{p.num_layers} full layers {pool}; {g.num_layers} sliding layers (window "
            f"{engine.window_blocks.window}) {g.num_blocks} blocks, {g_mb:.1f} MB"
        )
    return (
        f"nanoserve: {name} · {p.dtype} on {engine.model.device.type} · KV pool {pool}"
        f" · warm list {warm}{where}"
    )
