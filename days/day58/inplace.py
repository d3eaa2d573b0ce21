"""Day 58's benchmark: decode attention read in place (the native kernel) against the gathered
padded copy it replaces (`attention="gather"`), on the CPU.

Three tables, one CSV each, for 16 rows whose contexts are spread evenly up to the widest
(row r holds C * (r + 1) / 16 tokens), as a decode batch whose requests arrived at different
times would be:

* `day-58-bytes.csv`: arithmetic only, for SmolLM2-135M's shape (30 layers, 3 K/V heads, head
  dim 64, fp32). The gather path copies every row's window padded to the width W, K and V,
  and SDPA then reads that copy; the kernel reads each row's own slots and nothing else.
  Also the same for rows that all sit at C (no padding at all).
* `day-58-attention.csv`: one layer's decode attention, gather against native, with SmolLM2's
  head shape and windows made by `plan.slot_window` from lists of whole blocks, as a real
  step's block tables give them. Best of alternating runs; the two outputs asserted equal.
* `day-58-step.csv`: a whole decode step of SmolLM2 (fp32, 2 threads) at 16 rows, by widest
  context. One engine is prefilled once; its cache's `attention` is then switched between
  "gather" and "native" from one step to the next, so both read the same pools for the same
  batch. `day-58-profile.csv`: the top ops of one step of each at the widest context.

    python days/day58/inplace.py                  # all three (the step table loads SmolLM2)
    python days/day58/inplace.py --skip-step      # the bytes and one-layer tables only
"""

from __future__ import annotations

import argparse
import random
import time
from functools import partial
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.models import LlamaConfig
from nanoserve.plan import slot_window

HERE = Path(__file__).resolve().parent
ROWS, BLOCK = 16, 16
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64  # SmolLM2-135M
FP32 = 4
CONTEXTS = (64, 128, 256, 512, 1024, 2048)


def ragged_lens(widest: int, rows: int = ROWS) -> list[int]:
    """Row r holds widest * (r + 1) / rows tokens: 64 -> [4, 8, ..., 64]."""
    return [widest * (r + 1) // rows for r in range(rows)]


def width_of(lens: list[int], block_size: int = BLOCK) -> int:
    """The gather path's window width: the widest row's blocks, in slots."""
    return -(-max(lens) // block_size) * block_size


def copied_bytes(lens, kv_heads=KV_HEADS, head_dim=HEAD_DIM, itemsize=FP32) -> int:
    """Bytes the gather path copies per layer: K and V, every row padded to the width."""
    return 2 * len(lens) * width_of(lens) * kv_heads * head_dim * itemsize


def read_bytes(lens, kv_heads=KV_HEADS, head_dim=HEAD_DIM, itemsize=FP32) -> int:
    """Bytes the kernel reads per layer: K and V of each row's own slots, no more."""
    return 2 * sum(lens) * kv_heads * head_dim * itemsize


def bytes_table(contexts=CONTEXTS) -> list[dict]:
    out = []
    for shape in ("ragged", "uniform"):
        for c in contexts:
            lens = ragged_lens(c) if shape == "ragged" else [c] * ROWS
            copied, read = copied_bytes(lens), read_bytes(lens)
            out.append(
                {
                    "rows": shape,
                    "widest": c,
                    "width": width_of(lens),
                    "sum_len": sum(lens),
                    "copied_mb_layer": f"{copied / 1e6:.2f}",
                    "kernel_mb_layer": f"{read / 1e6:.2f}",
                    "copied_mb_step": f"{LAYERS * copied / 1e6:.1f}",
                    "kernel_mb_step": f"{LAYERS * read / 1e6:.1f}",
                    "ratio": f"{copied / read:.2f}",
                }
            )
    return out


def smol_shape(layers: int = 1) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=8,
        num_layers=layers,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
    )


def block_windows(lens: list[int], num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A (rows, W) slot window as a real step has it: each row owns whole blocks of 16
    consecutive slots, the blocks drawn at random from the pool and never shared."""
    rng = random.Random(seed)
    need = [-(-n // BLOCK) for n in lens]
    free = rng.sample(range(num_blocks), sum(need))
    lists, at = [], 0
    for k in need:
        lists.append(free[at : at + k])
        at += k
    return slot_window(lists, BLOCK, "cpu")


def attention_caches(lens: list[int], seed: int = 0):
    """A gather cache and a native cache over the same random one-layer pools, a window for
    `lens`, and one query per row."""
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 8
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * BLOCK + 1, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(num_blocks * BLOCK + 1, KV_HEADS, HEAD_DIM, generator=g)
    caches = {}
    for kind in ("gather", "native"):
        c = BatchedPagedKVCache(smol_shape(), num_blocks * BLOCK, attention=kind)
        c.k[0], c.v[0] = k, v  # both read the very same pools
        caches[kind] = c
    window = block_windows(lens, num_blocks, seed)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g)
    return caches, window, torch.tensor(lens), q


def time_alternating(fns: dict, reps: int) -> dict:
    """Best (least) seconds of each callable over `reps` turns, the two run in turn: on a shared
    machine the least time is the one least disturbed by other jobs."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


def layer_times(widest: int, reps: int) -> dict:
    """Best seconds of one layer's decode attention over 16 rows at `ragged_lens(widest)`, each
    way, after asserting that the two agree."""
    caches, window, ctx, q = attention_caches(ragged_lens(widest))
    with torch.inference_mode():
        ref = caches["gather"]._one_query_rows(0, q, window, ctx)
        got = caches["native"]._one_query_rows(0, q, window, ctx)
        assert (got - ref).abs().max().item() < 1e-5, "native and gather disagree"
        fns = {kind: partial(cache._one_query_rows, 0, q, window, ctx) for kind, cache in caches.items()}
        return time_alternating(fns, reps)


def attention_table(contexts=CONTEXTS, reps: int = 30) -> list[dict]:
    out = []
    for c in contexts:
        t = layer_times(c, reps)
        out.append(
            {
                "widest": c,
                "width": width_of(ragged_lens(c)),
                "gather_ms": f"{t['gather'] * 1e3:.3f}",
                "native_ms": f"{t['native'] * 1e3:.3f}",
                "speedup": f"{t['gather'] / t['native']:.2f}",
            }
        )
    return out


def prefilled_engine(model, widest: int, steps: int):
    """An engine over `model` holding 16 rows at `ragged_lens(widest)`, prompts all prefilled,
    each request allowed `steps` more decode steps. Prompts are random tokens, no two alike,
    and prefix caching is off, so every row owns its blocks."""
    from nanocourse import engine_config
    from nanoserve.engine import Engine
    from nanoserve.sampling import SamplingParams

    lens = ragged_lens(widest)
    budget = model.cfg.kv_bytes_per_token(torch.float32) * (sum(lens) + ROWS * (steps + 2 * BLOCK))
    config = engine_config(  # the engine as of day 58 (plain linears), with the kernel asked for
        58, max_batch=ROWS, max_model_len=widest + steps + 1, kv_budget=budget, attention="native",
        max_num_batched_tokens=2048, enable_prefix_caching=False,
    )  # fmt: skip
    eng = Engine(model, None, config)
    rng = random.Random(widest)
    for n in lens:  # a prompt of n - 1 tokens: the row's first decode step runs at context n
        prompt = [rng.randrange(100, model.cfg.vocab_size) for _ in range(n - 1)]
        eng.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    sched = eng.scheduler
    while sched.waiting or any(s.needs_prefill for s in sched.running):  # prefill, chunked
        eng.step()
    return eng


def switch(eng, kind: str) -> None:
    """Point the engine's cache at one way of reading decode rows. Only decode rows consult it
    (a prompt row's mask memo does too, and every prompt here is done), so a decode step after
    the switch is the step an engine built with engine_config(58, attention=kind) would take."""
    eng.cache.attention = kind


def label_attention(eng, label: str = "decode attention") -> None:
    """Wrap the cache's one-query-rows call in a profiler label: the native kernel is a plain
    C++ call that torch.profiler would not otherwise name."""
    inner = eng.cache._one_query_rows

    def labelled(*args):
        with torch.profiler.record_function(label):
            return inner(*args)

    eng.cache._one_query_rows = labelled


def profile_step(eng, kind: str, top: int = 6) -> tuple[list[dict], int]:
    """One decode step under torch.profiler: its `top` ops by self CPU time (the label of
    `label_attention` counts as one), and how many aten ops ran."""
    from nanocourse import cpu_profile

    switch(eng, kind)
    with cpu_profile() as prof:
        eng.step()
    stats = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    ops = [
        {"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
        for e in stats
        if e.key.startswith("aten::") or e.key == "decode attention"
    ]
    aten = sum(e.count for e in stats if e.key.startswith("aten::"))
    return ops[:top], aten


def step_times(eng, reps: int) -> dict:
    """Best seconds of a decode step with each way, the two alternating step by step."""

    def step(kind):
        switch(eng, kind)
        eng.step()

    return time_alternating({kind: (lambda kind=kind: step(kind)) for kind in ("gather", "native")}, reps)


def step_table(contexts=(128, 512, 1024), reps: int = 4, model=None) -> tuple[list[dict], list[dict]]:
    """(the step table, the profile table of the widest context)."""
    from nanoserve.models import load_model
    from nanoserve.weights import fetch_default_model

    if model is None:
        model = load_model(fetch_default_model())
    out, profile = [], []
    for c in contexts:
        t0 = time.perf_counter()
        eng = prefilled_engine(model, c, steps=2 * reps + 6)
        prefill_s = time.perf_counter() - t0
        t = step_times(eng, reps)
        out.append(
            {
                "widest": c,
                "sum_len": sum(ragged_lens(c)),
                "gather_ms": f"{t['gather'] * 1e3:.1f}",
                "native_ms": f"{t['native'] * 1e3:.1f}",
                "speedup": f"{t['gather'] / t['native']:.2f}",
                "prefill_s": f"{prefill_s:.1f}",
            }
        )
        print("  ", out[-1], flush=True)
        if c == contexts[-1]:
            label_attention(eng)
            for kind in ("gather", "native"):
                ops, aten = profile_step(eng, kind)
                for rank, op in enumerate(ops, 1):
                    profile.append(
                        {"attention": kind, "widest": c, "rank": rank, "op": op["op"], "calls": op["calls"],
                         "self_ms": f"{op['self_ms']:.1f}", "aten_ops": aten}
                    )  # fmt: skip
    return out, profile


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skip-step", action="store_true", help="leave the SmolLM2 step table as it is")
    p.add_argument("--reps", type=int, default=30, help="timed runs of each variant, one layer")
    p.add_argument("--step-reps", type=int, default=4, help="timed decode steps of each variant")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    print(cpu_line())
    t0 = time.perf_counter()
    tables = {"day-58-bytes.csv": bytes_table(), "day-58-attention.csv": attention_table(reps=args.reps)}
    if not args.skip_step:
        tables["day-58-step.csv"], tables["day-58-profile.csv"] = step_table(reps=args.step_reps)
    for name, rows in tables.items():
        write_csv(rows, HERE / name, cpu=name != "day-58-bytes.csv")
        print(name)
        for row in rows:
            print("  ", row)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
