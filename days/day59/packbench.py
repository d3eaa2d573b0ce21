"""Day 59's benchmark: linears on weights packed once for oneDNN (`model.pack_linears`) against
the plain path of day 12, decode attention's AVX2 kernel, and the 16-row decode step they make
up (CPU, fp32).

Five CSVs, next to this file:

* `day-59-threads.csv`: why the other tables run on one thread. Single calls of one linear at
  1 row, on 1 and on 2 threads: on a 2-core machine shared with other jobs, a call on two
  threads can wait for the second one to be scheduled, and the slow tail shows it.
* `day-59-linears.csv`: the linears of one decode step of SmolLM2-135M's shape, the 30 blocks'
  four matrices (qkv, o, gate_up, down) and the 49152 x 576 head, with random weights drawn
  separately for every layer, so each matrix is as cold in cache as a real step finds it. Per
  row count: ms and GFLOP/s plain and packed (for 16 rows, as the engine packs for its
  max_batch), the passes taking turns, best of `--reps`; at 1 row also weights packed for 1.
* `day-59-attention.csv`: one layer's decode attention over 16 rows whose lengths run evenly
  from C/2 to C, windows made of whole 16-slot blocks scattered over the pool: bytes and flops
  per layer, then the gather path of days 18-57 against the native kernel (the AVX2 build this
  CPU gets) and, with `--portable`, the same source built without its AVX2 block (day 58's
  loop, compiled with the same flags), all asserted equal first.
* `day-59-step.csv`: whole SmolLM2 steps at 16 rows, an engine with `linear="plain"` against
  one with `linear="packed"`, over the same prompts, their steps alternating: decode steps at
  two contexts, and mixed steps (15 decode rows plus a 128-token prompt chunk). Each step's time
  is split into the blocks' linears, the head, attention and the rest by clocks wrapped around
  `nanoserve.models.linear` and the cache's `paged_attention` (this script's, for measuring).
* `day-59-profile.csv`: `torch.profiler`'s top ops by self time in one decode step of each.

    python days/day59/packbench.py --portable         # what the committed CSVs come from
    python days/day59/packbench.py --threads 2        # on a machine nobody else is using
    python days/day59/packbench.py --skip-step --rows 1 16 --reps 3
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import random
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from nanocourse import cpu_profile, write_csv
from nanoserve.bench import cpu_line
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.models import LlamaConfig, pack_linears
from nanoserve.plan import slot_window

HERE = Path(__file__).resolve().parent
# SmolLM2-135M
HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = {
    "qkv": (960, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
ROWS, BLOCK, FP32 = 16, 16, 4


# --- packing ---------------------------------------------------------------------------------


def pack(w: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """One weight (out, in) reordered for oneDNN's GEMM, as `pack_linears` does to each matrix."""
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


def tiles(w: torch.Tensor) -> torch.Tensor:
    """w (out, in) in the order oneDNN's `AB16b64a` format keeps it: (out/64, in/16, 16, 64),
    tile (a, b) holding inputs 16b..16b+15 by outputs 64a..64a+63, one input's 64 outputs side
    by side. This CPU's oneDNN picks that format for fp32 at 4 rows and more."""
    out, inp = w.shape
    return w.view(out // 64, 64, inp // 16, 16).permute(0, 2, 3, 1)  # (A, B, 16 in, 64 out)


def packed_floats(p: torch.Tensor) -> torch.Tensor:
    """The fp32 numbers of an opaque oneDNN tensor, in the order they lie in its memory."""
    ptr, nbytes = torch.ops.mkldnn.data_ptr(p), torch.ops.mkldnn._nbytes(p)
    raw = bytearray((ctypes.c_char * nbytes).from_address(ptr))  # a copy; p stays as it was
    return torch.frombuffer(raw, dtype=torch.float32).clone()


def onednn_log(fn) -> list[str]:
    """The primitives oneDNN ran during fn(), one line each from its verbose log (which it
    writes to file descriptor 1, captured here), the last field, a time, left off:
    "reorder,jit:uni,...,dst:f32::blocked:AB16b64a::f0,...,960x576"."""
    sys.stdout.flush()
    with tempfile.TemporaryFile(mode="w+") as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        lines = f.read().splitlines()
    return [ln.split(",exec,cpu,", 1)[1].rsplit(",", 1)[0] for ln in lines if ",exec,cpu," in ln]


def weight_layout(line: str) -> str:
    """The weight's format in one `onednn_log` line: a reorder's destination, a product's weights."""
    return re.search(r"(?:dst|wei):f32::blocked:(\w+)", line).group(1)


def packed_twin(model, rows: int = 16):
    """A second module tree over the very same tensors, with its linears then packed: the model
    handed in stays plain (pack_linears works in place and one way)."""
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    twin = copy.deepcopy(model, shared)  # modules copied, tensors shared
    pack_linears(twin, rows)
    return twin


# --- one step's linears ----------------------------------------------------------------------


def block_params(layers: int = LAYERS) -> int:
    return layers * sum(o * i for o, i in SHAPES.values())


def step_weights(layers: int = LAYERS, seed: int = 0):
    """Random weights of SmolLM2's shapes, distinct per layer: [{name: (out, in)}] and the head."""
    g = torch.Generator().manual_seed(seed)
    blocks = [
        {n: torch.randn(o, i, generator=g) * 0.02 for n, (o, i) in SHAPES.items()} for _ in range(layers)
    ]
    return blocks, torch.randn(VOCAB, HIDDEN, generator=g) * 0.02


def linear_pass(blocks, head, inputs) -> tuple[float, float]:
    """Seconds for every block matrix in layer order, then for the head, through `linear`."""
    from nanoserve.models import linear

    t0 = time.perf_counter()
    for layer in blocks:
        for w in layer.values():
            linear(inputs[w.shape[1]], w)
    t1 = time.perf_counter()
    linear(inputs[HIDDEN], head)
    return t1 - t0, time.perf_counter() - t1


def linear_times(rows: int, weights, reps: int) -> dict:
    """Best seconds of (blocks, head) plain and packed at `rows` rows, the two passes in turn.
    weights: {"plain": (blocks, head), "packed": (blocks, head)}."""
    g = torch.Generator().manual_seed(rows)
    inputs = {n: torch.randn(rows, n, generator=g) for n in (HIDDEN, INTER)}
    best = {kind: [float("inf"), float("inf")] for kind in weights}
    with torch.inference_mode():
        for blocks, head in weights.values():
            linear_pass(blocks, head, inputs)  # warm: first calls build oneDNN's primitives
        for _ in range(reps):
            for kind, (blocks, head) in weights.items():
                b, h = linear_pass(blocks, head, inputs)
                best[kind] = [min(best[kind][0], b), min(best[kind][1], h)]
    return best


def packed_weights(blocks, head, rows: int = 16):
    return [{n: pack(w, rows) for n, w in layer.items()} for layer in blocks], pack(head, rows)


def linears_table(rows_list=(1, 4, 16, 64), layers: int = LAYERS, reps: int = 5, pack_rows: int = 16):
    """Per row count and part (the blocks' 120 matrices, the head, both): plain against packed
    for `pack_rows` rows, as the engine packs for its max_batch. At 1 row a third variant takes
    its turn as well: the weights packed for 1 row (`packed_for1_ms`), which oneDNN keeps in the
    plain (out, in) order."""
    blocks, head = step_weights(layers)
    weights = {"plain": (blocks, head), "packed": packed_weights(blocks, head, pack_rows)}
    params = {"blocks": block_params(layers), "head": VOCAB * HIDDEN}
    out = []
    for rows in rows_list:
        kinds = dict(weights)
        if rows == 1:
            kinds["packed1"] = packed_weights(blocks, head, 1)
        t = linear_times(rows, kinds, reps)
        if rows == 1:
            del kinds["packed1"]
        for k, part in enumerate(("blocks", "head", "all")):
            ms = {kind: (v[k] if k < 2 else sum(v)) * 1e3 for kind, v in t.items()}
            n = params[part] if k < 2 else sum(params.values())
            flop = 2 * rows * n
            out.append(
                {
                    "rows": rows,
                    "part": part,
                    "matrices": (4 * layers if part == "blocks" else 1 if part == "head" else 4 * layers + 1),
                    "weight_mb": f"{n * FP32 / 1e6:.1f}",
                    "gflop": f"{flop / 1e9:.3f}",
                    "plain_ms": f"{ms['plain']:.2f}",
                    "packed_ms": f"{ms['packed']:.2f}",
                    "plain_gflops": f"{flop / ms['plain'] / 1e6:.1f}",
                    "packed_gflops": f"{flop / ms['packed'] / 1e6:.1f}",
                    "speedup": f"{ms['plain'] / ms['packed']:.2f}",
                    "packed_for1_ms": f"{ms['packed1']:.2f}" if "packed1" in ms else "",
                }
            )
            print("  ", out[-1], flush=True)
    return out


def threads_table(thread_counts=(1, 2), calls: int = 30, reps: int = 4) -> list[dict]:
    """Per thread count, single calls of one linear at 1 row: 30 distinct gate_up matrices
    (3072 x 576), plain and packed, every call timed alone, `reps` passes over all 30. Two
    threads split a call in two; on a shared machine a call's parallel region can also wait for
    the second thread to be scheduled, which shows in the slow tail (p90, max)."""
    from nanoserve.models import linear

    g = torch.Generator().manual_seed(1)
    plain = [torch.randn(2 * INTER, HIDDEN, generator=g) * 0.02 for _ in range(calls)]
    kinds = {"plain": plain, "packed": [pack(w, 16) for w in plain]}
    x = torch.randn(1, HIDDEN, generator=g)
    saved, out = torch.get_num_threads(), []
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for kind, ws in kinds.items():
                samples = []
                with torch.inference_mode():
                    for w in ws:
                        linear(x, w)  # warm
                    for _ in range(reps):
                        for w in ws:
                            t0 = time.perf_counter()
                            linear(x, w)
                            samples.append((time.perf_counter() - t0) * 1e3)
                ms = sorted(samples)
                n = len(ms)
                out.append(
                    {
                        "threads": threads,
                        "linear": kind,
                        "calls": n,
                        "min_ms": f"{ms[0]:.2f}",
                        "median_ms": f"{ms[n // 2]:.2f}",
                        "p90_ms": f"{ms[n * 9 // 10]:.2f}",
                        "max_ms": f"{ms[-1]:.2f}",
                        "total_ms": f"{sum(ms):.1f}",
                    }
                )
                print("  ", out[-1], flush=True)
    finally:
        torch.set_num_threads(saved)
    return out


# --- decode attention ------------------------------------------------------------------------


def spread_lens(widest: int, rows: int = ROWS) -> list[int]:
    """Row r holds C/2 + C/2 * (r + 1) / rows tokens: 64 -> [34, 36, ..., 64]."""
    half = widest // 2
    return [half + half * (r + 1) // rows for r in range(rows)]


def attention_bytes(lens) -> int:
    """Bytes one layer's decode attention must read: K and V of every row's own slots."""
    return 2 * sum(lens) * KV_HEADS * HEAD_DIM * FP32


def attention_flops(lens) -> int:
    """q.k for every key and query head, then the weighted sum of values: 2 x 2 x hd each."""
    return 4 * sum(lens) * HEADS * HEAD_DIM


def smol_shape(layers: int = 1) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=8, num_layers=layers, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
    )  # fmt: skip


def attention_inputs(lens, seed: int = 0):
    """(gather cache, native cache, window, context_lens, q) over the same random one-layer
    pools; each row owns whole blocks of 16 slots drawn at random from the pool."""
    rng = random.Random(seed)
    need = [-(-n // BLOCK) for n in lens]
    num_blocks = 2 * sum(need) + 8
    free = rng.sample(range(num_blocks), sum(need))
    lists = [free[sum(need[:r]) : sum(need[: r + 1])] for r in range(len(lens))]
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * BLOCK + 1, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(num_blocks * BLOCK + 1, KV_HEADS, HEAD_DIM, generator=g)
    caches = []
    for kind in ("gather", "native"):
        c = BatchedPagedKVCache(smol_shape(), num_blocks * BLOCK, attention=kind)
        c.k[0], c.v[0] = k, v
        caches.append(c)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g)
    return (*caches, slot_window(lists, BLOCK, "cpu"), torch.tensor(lens), q)


def portable_kernel():
    """The kernel's source built with its AVX2 block switched off, flags as `kernels.native()`
    has them: the portable loop of day 58, on this same CPU, for timing against the AVX2 one."""
    from torch.utils.cpp_extension import load

    src = (Path(__file__).resolve().parents[2] / "nanoserve" / "csrc" / "paged_attention.cpp").read_text()
    guard = "#if defined(__AVX2__) && defined(__FMA__)"
    assert guard in src, "the kernel's AVX2 guard moved; update portable_kernel"
    folder = Path(tempfile.mkdtemp(prefix="nanoserve-portable-"))
    (folder / "portable.cpp").write_text(src.replace(guard, "#if 0  /* portable build */", 1))
    ext = load(
        name="nanoserve_day59_portable",
        sources=[str(folder / "portable.cpp")],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )
    assert ext.isa() == "portable"
    return ext


def time_alternating(fns: dict, reps: int) -> dict:
    """Least seconds of each callable over `reps` turns, all taking turns."""
    times = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return times


def attention_times(widest: int, reps: int, portable=None) -> dict:
    """Best seconds of one layer's decode attention at `spread_lens(widest)`, gather against the
    native kernel (and the portable build), after asserting that they agree to 1e-5."""
    from nanoserve.kernels import native

    gather, nat, window, ctx, q = attention_inputs(spread_lens(widest))
    k, v, scale = nat.k[0], nat.v[0], HEAD_DIM**-0.5
    fns = {
        "gather": lambda: gather._one_query_rows(0, q, window, ctx),
        "native": lambda: native().decode_attention(q, k, v, window, ctx, scale),
    }
    if portable is not None:
        fns["portable"] = lambda: portable.decode_attention(q, k, v, window, ctx, scale)
    with torch.inference_mode():
        ref = fns["gather"]()
        for name, fn in fns.items():
            assert (fn() - ref).abs().max().item() < 1e-5, f"{name} and gather disagree"
        return time_alternating(fns, reps)


def attention_table(contexts=(64, 256, 1024), reps: int = 30, portable=None) -> list[dict]:
    out = []
    for c in contexts:
        lens = spread_lens(c)
        t = attention_times(c, reps, portable)
        read = attention_bytes(lens)
        row = {
            "widest": c,
            "sum_len": sum(lens),
            "read_kb": f"{read / 1e3:.1f}",
            "mflop": f"{attention_flops(lens) / 1e6:.2f}",
            "flop_per_byte": f"{attention_flops(lens) / read:.2f}",
            "gather_ms": f"{t['gather'] * 1e3:.3f}",
            "portable_ms": f"{t['portable'] * 1e3:.3f}" if "portable" in t else "",
            "avx2_ms": f"{t['native'] * 1e3:.3f}",
            "avx2_gbs": f"{read / t['native'] / 1e9:.1f}",
            "gather_over_avx2": f"{t['gather'] / t['native']:.2f}",
            "portable_over_avx2": f"{t['portable'] / t['native']:.2f}" if "portable" in t else "",
        }
        out.append(row)
        print("  ", row, flush=True)
    return out


# --- whole steps -----------------------------------------------------------------------------


def prefilled_engines(models: dict, lens, steps: int, tok=None, seed: int = 0) -> dict:
    """One engine per model ({"plain": model, "packed": twin}), each holding 16 rows at `lens`
    with the same random prompts, prefilled; prefix caching off so no row shares a block."""
    from nanocourse import engine_config
    from nanoserve.engine import Engine
    from nanoserve.sampling import SamplingParams

    cfg = next(iter(models.values())).cfg
    budget = cfg.kv_bytes_per_token(torch.float32) * (sum(lens) + len(lens) * (steps + 2 * BLOCK) + 1024)
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, cfg.vocab_size) for _ in range(n - 1)] for n in lens]
    engines = {}
    for kind, model in models.items():
        config = engine_config(
            59, max_batch=len(lens), max_model_len=max(lens) + steps + 256, kv_budget=budget, linear=kind,
            max_num_batched_tokens=2048, enable_prefix_caching=False,
        )  # fmt: skip
        eng = Engine(model, tok, config)
        assert eng.linear == kind, f"asked for {kind}, the engine runs {eng.linear}"
        for p in prompts:  # a prompt of n - 1 tokens: its first decode step runs at context n
            eng.add_request(p, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        while eng.scheduler.waiting or any(s.needs_prefill for s in eng.scheduler.running):
            eng.step()
        engines[kind] = eng
    return engines


@contextmanager
def component_clock(eng, into: dict):
    """While active, add the seconds spent in the blocks' linears, the head and attention to
    `into` by wrapping `nanoserve.models.linear` (the head is the matrix with a row per vocabulary
    entry) and this engine's `cache.paged_attention`."""
    import nanoserve.models.llama as m

    inner_linear, inner_attention = m.linear, eng.cache.paged_attention
    vocab = eng.model.cfg.vocab_size

    def timed_linear(x, w):
        t0 = time.perf_counter()
        y = inner_linear(x, w)
        into["head" if w.shape[0] == vocab else "linears"] += time.perf_counter() - t0
        return y

    def timed_attention(*args):
        t0 = time.perf_counter()
        y = inner_attention(*args)
        into["attention"] += time.perf_counter() - t0
        return y

    m.linear, eng.cache.paged_attention = timed_linear, timed_attention
    try:
        yield into
    finally:
        m.linear = inner_linear
        del eng.cache.paged_attention  # the instance attribute: the method shows through again


def timed_step(eng) -> dict:
    """One engine step with its time split into parts (ms)."""
    parts = {"linears": 0.0, "head": 0.0, "attention": 0.0}
    with component_clock(eng, parts):
        t0 = time.perf_counter()
        eng.step()
        total = time.perf_counter() - t0
    ms = {k: v * 1e3 for k, v in parts.items()}
    return {"step": total * 1e3, **ms, "rest": total * 1e3 - sum(ms.values())}


def best_steps(engines: dict, reps: int, before=None, after=None) -> dict:
    """Per engine, the split of its fastest of `reps` steps, the engines taking turns;
    `before(eng, turn)` and `after(eng, turn)` run untimed around each step."""
    best = {}
    for turn in range(reps):
        for kind, eng in engines.items():
            if before is not None:
                before(eng, turn)
            t = timed_step(eng)
            if after is not None:
                after(eng, turn)
            if kind not in best or t["step"] < best[kind]["step"]:
                best[kind] = t
    return best


def mixed_hooks(prompt_len: int = 128, seed: int = 1):
    """(before, after) for mixed steps: before adds the turn's prompt of `prompt_len` random
    tokens (one per turn, the same for every engine), after checks that the step was mixed and
    aborts the request, so each turn starts from the same 15 decode rows."""
    from nanoserve.sampling import SamplingParams

    rng, prompts, added = random.Random(seed), {}, {}

    def before(eng, turn):
        if turn not in prompts:
            prompts[turn] = [rng.randrange(100, eng.model.cfg.vocab_size) for _ in range(prompt_len)]
        added[id(eng)] = (
            eng.add_request(prompts[turn], SamplingParams(max_tokens=4)),
            eng.step_kinds["mixed"],
        )

    def after(eng, turn):
        rid, mixed = added.pop(id(eng))
        assert eng.step_kinds["mixed"] == mixed + 1, "that step was not a mixed one"
        eng.abort(rid)

    return before, after


def profile_step(eng, top: int = 6) -> tuple[list[dict], int]:
    """One step under torch.profiler: its `top` aten/mkldnn ops by self CPU time, and the count
    of such ops the step ran."""
    with cpu_profile() as prof:
        eng.step()
    stats = [e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::"))]
    stats.sort(key=lambda e: -e.self_cpu_time_total)
    ops = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in stats]
    return ops[:top], sum(e.count for e in stats)


def step_row(step, widest, tokens, kind, t, plain_ms) -> dict:
    return {
        "step": step,
        "widest": widest,
        "tokens": tokens,
        "linear": kind,
        "step_ms": f"{t['step']:.1f}",
        "linears_ms": f"{t['linears']:.1f}",
        "head_ms": f"{t['head']:.1f}",
        "attention_ms": f"{t['attention']:.1f}",
        "rest_ms": f"{t['rest']:.1f}",
        "vs_plain": f"{plain_ms / t['step']:.2f}",
    }


def step_table(contexts=(64, 256), reps: int = 6, prompt_len: int = 128, model=None):
    """(the step table, the profile table at the widest context)."""
    from nanoserve.models import load_model
    from nanoserve.weights import fetch_default_model

    model = model if model is not None else load_model(fetch_default_model())
    models = {"plain": model, "packed": packed_twin(model, ROWS)}
    out, profile = [], []
    for c in contexts:
        lens = spread_lens(c)
        engines = prefilled_engines(models, lens, steps=3 * reps + 8, seed=c)
        best = best_steps(engines, reps)
        for kind in engines:
            out.append(step_row("decode", c, ROWS, kind, best[kind], best["plain"]["step"]))
            print("  ", out[-1], flush=True)
        if c == contexts[-1]:
            for kind, eng in engines.items():
                ops, count = profile_step(eng)
                for rank, op in enumerate(ops, 1):
                    profile.append(
                        {"linear": kind, "widest": c, "rank": rank, "op": op["op"], "calls": op["calls"],
                         "self_ms": f"{op['self_ms']:.1f}", "ops_in_step": count}
                    )  # fmt: skip
            for eng in engines.values():  # 15 decode rows, and room for one prompt chunk
                eng.abort(eng.scheduler.running[-1].request_id)
            before, after = mixed_hooks(prompt_len)
            best = best_steps(engines, reps, before, after)
            for kind in engines:
                row = step_row("mixed", c, ROWS - 1 + prompt_len, kind, best[kind], best["plain"]["step"])
                out.append(row)
                print("  ", row, flush=True)
    return out, profile


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="row counts for the linears")
    p.add_argument("--layers", type=int, default=LAYERS, help="blocks of weights in the linears table")
    p.add_argument("--reps", type=int, default=5, help="timed passes of each variant, linears")
    p.add_argument("--attention-reps", type=int, default=30, help="timed calls of each variant, one layer")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256], help="widest contexts, step table")
    p.add_argument("--step-reps", type=int, default=6, help="timed steps of each engine")
    p.add_argument(
        "--portable", action="store_true", help="build the portable kernel for the attention table"
    )
    p.add_argument("--skip-step", action="store_true", help="leave the SmolLM2 step tables as they are")
    p.add_argument("--threads", type=int, default=1, help="torch threads for every table but the threads one")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line(), flush=True)
    t0 = time.perf_counter()
    tables = {"day-59-threads.csv": threads_table()}
    tables["day-59-linears.csv"] = linears_table(args.rows, args.layers, args.reps)
    portable = portable_kernel() if args.portable else None
    tables["day-59-attention.csv"] = attention_table(reps=args.attention_reps, portable=portable)
    if not args.skip_step:
        tables["day-59-step.csv"], tables["day-59-profile.csv"] = step_table(args.contexts, args.step_reps)
    for name, rows in tables.items():
        write_csv(rows, HERE / name, cpu=True)
        print(name)
        for row in rows:
            print("  ", row)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
