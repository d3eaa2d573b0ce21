"""Day 28: what admission weighs, and what the watermark reserve saves on a tight pool.

Admission (`Scheduler._schedule_prefill`) takes the request at the front of the waiting queue
only if four things allow it: a free row (`max_batch`), budget left in the step
(`max_num_batched_tokens`), the reserve (`Scheduler.can_admit`: after the prompt's blocks and
the block its first token needs, the free list must still hold a block for every running
sequence whose next token starts a new block, plus `watermark` of the pool) and the blocks
themselves (`BlockAllocator.allocate_prompt`). Three reserves are compared:

* `last free blocks`: `watermark=None`, the earlier policy, no reserve at all;
* `watermark`: the engine's default, 5% of the pool plus the running sequences' next blocks;
* `watermark, no next blocks`: a reserve built wrong, the 5% share alone.

A preemption is `immediate` when its victim was admitted in the step before: the prompt took
the last free blocks and the very next decode step threw its prefill away. That is the thrash
the reserve exists to stop.

Three CSVs:

* `day-28-tight.csv`: the tight pool of `tests/test_faults.py` (6 blocks of 4 tokens; `a` is
  decoding and needs a third block next, `b` arrives with 15 prompt tokens), driven without a
  model by `drive`: per reserve, preemptions, immediate ones, tokens recomputed, steps, prompt
  tokens computed.
* `day-28-sweep.csv`: `python -m nanoserve.bench admission`'s own workload (64 requests,
  prompts of 16 to 256 tokens, 16 to 128 to generate, 90 blocks, 32 rows, a context of 512)
  through `drive` for watermark shares from none to 20%, and the wrong reserve: the same counts.
* `day-28-admission.csv`: `bench.throughput_workload` (random prompts and outputs, EOS ignored)
  through the engine on SmolLM2-135M-Instruct with a pool far smaller than the load, as
  `python -m nanoserve.bench admission` does but smaller: the same counts per reserve, whether
  every request's tokens equal the default's (near-ties excused as the tests do, and counted),
  and the run's seconds and tokens/s.

The engine is the one of day 28 (`engine_config(28)`: prefill-first, where admission runs
before decode and the reserve matters most; the gather read of the pool; the model's own
linears) with prefix caching off, so a preempted prompt recomputes all it lost. The counts depend
only on lengths and the policy, never on the model, so `drive` reproduces the engine's counts
exactly (asserted here, and in the notebook); the timings are this machine's.

    python days/day28/admitbench.py                   # writes the three CSVs next to this file
    python days/day28/admitbench.py --no-model        # only the model-free two, in a second
    python days/day28/admitbench.py --requests 64 --prompt-len 16 256 --output-len 16 128 \
        --kv-blocks 90 --max-batch 32 --max-model-len 512   # bench admission's workload
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanocourse import engine_config, top2_gap, write_csv
from nanoserve.bench import cpu_line, throughput_workload
from nanoserve.blocks import BlockAllocator
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Scheduler, Sequence

HERE = Path(__file__).resolve().parent


class NoNextBlocks(Scheduler):
    """A reserve built wrong: the watermark's share of the pool, forgetting that every running
    sequence whose next token starts a block will take one before anything new can."""

    def reserve(self) -> int:
        if self.watermark is None or not self.running:
            return 0
        return int(self.watermark * self.allocator.num_blocks)


RESERVES = {  # name -> (watermark, scheduler class)
    "last free blocks": (None, Scheduler),
    "watermark": (EngineConfig.watermark, Scheduler),
    "watermark, no next blocks": (EngineConfig.watermark, NoNextBlocks),
}


@dataclass
class Counts:
    preemptions: int = 0
    immediate: int = 0  # victims admitted in the step before
    recomputed_tokens: int = 0
    steps: int = 0
    prompt_tokens: int = 0  # tokens computed in prompt chunks, recomputation included


class Watch:
    """Counts what a scheduler does, by wrapping its `schedule` and `preempt`: steps, prompt
    tokens, preemptions, and the immediate ones (victim admitted in the step before)."""

    def __init__(self, sched: Scheduler):
        self.sched, self.counts, self.admitted = sched, Counts(), {}
        real_schedule, real_preempt = sched.schedule, sched.preempt

        def schedule():
            before = set(sched.running)
            batch = real_schedule()
            for seq in sched.running:
                if seq not in before:
                    self.admitted[seq] = self.counts.steps
            if batch.seqs:
                self.counts.steps += 1
                self.counts.prompt_tokens += sum(end - start for _, start, end in batch.chunks)
            return batch

        def preempt(seq):  # called inside schedule, before this step is counted
            self.counts.preemptions += 1
            self.counts.immediate += self.admitted.get(seq) == self.counts.steps - 1
            real_preempt(seq)

        sched.schedule, sched.preempt = schedule, preempt

    def result(self) -> Counts:
        self.counts.recomputed_tokens = self.sched.recomputed_tokens
        return self.counts


def drive(sched: Scheduler, first: list[Sequence], later=(), max_model_len: int = 2048) -> Counts:
    """Run a scheduler to the end without a model, as the engine's step would: chunks and decode
    rows mark their tokens computed, a row whose tokens are all computed gains one token (id 1),
    a sequence ends at its max_tokens or the context length. `first` is queued before the first
    step, `later` after it."""
    watch = Watch(sched)
    for s in first:
        sched.add(s)
    pending = list(later)
    while sched.has_work() or pending:
        batch = sched.schedule()
        for seq, _, end in batch.chunks:
            seq.num_computed = end
        for seq in batch.decode:
            seq.num_computed = len(seq.token_ids)
        for seq in batch.seqs:
            if seq.num_computed == len(seq.token_ids):
                seq.token_ids.append(1)
                if len(seq.output_ids) >= seq.max_tokens or len(seq.token_ids) >= max_model_len:
                    sched.finish(seq, "length")
        for s in pending:
            sched.add(s)
        pending = []
    return watch.result()


def tight_pool(name: str) -> tuple[Scheduler, Sequence, Sequence]:
    """tests/test_faults.py's pool: 6 blocks of 4, `a` (8 prompt tokens, 6 to generate) and `b`
    (15 prompt tokens, 4 to generate), b queued after a's first step; prefill-first."""
    watermark, cls = RESERVES[name]
    alloc = BlockAllocator(6, 4, enable_prefix_caching=False)
    sched = cls(alloc, max_batch=4, max_num_batched_tokens=64, watermark=watermark, policy="prefill-first")
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=6), 4)
    b = Sequence("b", list(range(100, 115)), SamplingParams(max_tokens=4), 4)
    a.max_tokens, b.max_tokens = 6, 4
    return sched, a, b


def tight_table() -> list[dict]:
    rows = []
    for name in RESERVES:
        sched, a, b = tight_pool(name)
        c = drive(sched, [a], [b])
        assert a.finished and b.finished and sched.allocator.num_used == 0
        rows.append({"reserve": name, **vars(c)})
    return rows


def workload_seqs(reqs, block_size: int, max_model_len: int) -> list[Sequence]:
    seqs = []
    for i, (ids, n) in enumerate(reqs):
        s = Sequence(f"req-{i}", list(ids), SamplingParams(max_tokens=n, ignore_eos=True), block_size)
        s.max_tokens = min(n, max_model_len - len(ids))
        seqs.append(s)
    return seqs


def config_for(name: str, args) -> EngineConfig:
    """The engine as of day 28 (prefill-first, the gather read, the model's own linears) with the
    named reserve's watermark."""
    watermark, _ = RESERVES[name]
    return engine_config(
        28,
        max_batch=args.max_batch,
        max_model_len=args.max_model_len,
        kv_budget=args.kv_blocks * args.per_block + args.per_block // 2,
        watermark=watermark,
        enable_prefix_caching=False,  # a preempted prompt recomputes all it lost (day 29)
    )


def drive_workload(name: str, reqs, args) -> Counts:
    """The counts the engine will report for this workload, computed without a model."""
    watermark, cls = RESERVES[name]
    alloc = BlockAllocator(args.kv_blocks, 16, enable_prefix_caching=False)
    sched = cls(alloc, args.max_batch, EngineConfig.max_num_batched_tokens, watermark, "prefill-first")
    return drive(sched, workload_seqs(reqs, 16, args.max_model_len), max_model_len=args.max_model_len)


def run_engine(model, tok, name: str, reqs, args) -> tuple[Counts, list[list[int]], float]:
    """The workload through a fresh engine: its counts, every request's tokens, seconds."""
    _, cls = RESERVES[name]
    engine = Engine(model, tok, config_for(name, args))
    assert engine.pool.num_blocks == args.kv_blocks, engine.pool.num_blocks
    engine.scheduler.__class__ = cls
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    watch = Watch(engine.scheduler)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [n for _, n in reqs], "a request did not get its tokens"
    assert engine.allocator.num_used == 0
    return watch.result(), [o.token_ids for o in outs], seconds


# `python -m nanoserve.bench admission`'s workload, for the sweep (model-free, so at full size)
BENCH = dict(
    requests=64, prompt_len=(16, 256), output_len=(16, 128), kv_blocks=90, max_batch=32, max_model_len=512
)
SHARES = (None, 0.0, 0.01, 0.02, 0.05, 0.1, 0.2)


def sweep_table(seed: int = 0) -> list[dict]:
    """The bench's admission workload through `drive` for a range of watermark shares (None: no
    reserve at all; 0.0: the running sequences' next blocks alone), and the wrong reserve."""
    b = argparse.Namespace(**BENCH)
    reqs = throughput_workload(b.requests, b.prompt_len, b.output_len, 49152, seed)
    rows = []
    for share in SHARES + ("no next blocks",):
        if share == "no next blocks":
            name, watermark, cls = "watermark, no next blocks", EngineConfig.watermark, NoNextBlocks
        else:
            name = "last free blocks" if share is None else "next blocks + share"
            watermark, cls = share, Scheduler
        alloc = BlockAllocator(b.kv_blocks, 16, enable_prefix_caching=False)
        sched = cls(alloc, b.max_batch, EngineConfig.max_num_batched_tokens, watermark, "prefill-first")
        counts = drive(sched, workload_seqs(reqs, 16, b.max_model_len), max_model_len=b.max_model_len)
        reserve_blocks = "" if watermark is None else int(watermark * b.kv_blocks)
        share_cell = "none" if watermark is None else watermark
        rows.append(
            {"reserve": name, "watermark": share_cell, "share_blocks": reserve_blocks, **vars(counts)}
        )
    return rows


def admission_table(model, tok, args) -> list[dict]:
    """Every reserve on the workload through the engine; counts checked against `drive`."""
    reqs = throughput_workload(
        args.requests, args.prompt_len, args.output_len, model.cfg.vocab_size, args.seed
    )

    runs = {}
    for name in RESERVES:
        counts, tokens, seconds = run_engine(model, tok, name, reqs, args)
        assert counts == drive_workload(name, reqs, args), f"{name}: the engine's counts are not drive's"
        runs[name] = counts, tokens, seconds
        print(f"{name:>26}: {counts}, {seconds:.1f} s", flush=True)
    base = runs["watermark"][1]
    rows = []
    for name, (counts, tokens, seconds) in runs.items():
        equal = ties = 0
        for (prompt, _), ref, got in zip(reqs, base, tokens):
            if got == ref:
                equal += 1
                continue
            k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            gap = top2_gap(model, prompt + ref[:k])
            assert gap < 1e-4, f"{name}: tokens differ at {k} with a top-2 gap of {gap:.2e}"
            ties += 1
        useful = sum(len(t) for t in tokens)
        rows.append(
            {
                "reserve": name,
                "kv_blocks": args.kv_blocks,
                **vars(counts),
                "same_tokens": equal,
                "near_ties": ties,
                "requests": len(reqs),
                "useful_tokens": useful,
                "seconds": f"{seconds:.1f}",
                "tok_s": f"{useful / seconds:.1f}",
                "cpu": cpu_line(),
            }
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 32], metavar=("MIN", "MAX"))
    ap.add_argument("--kv-blocks", type=int, default=24, help="blocks of 16 tokens in the pool")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", default=str(HERE))
    ap.add_argument("--no-model", action="store_true", help="only the model-free tables (tight, sweep)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    print(cpu_line())
    out = Path(args.out_dir)
    tight = tight_table()
    for r in tight:
        print("tight pool:", r)
    write_csv(tight, out / "day-28-tight.csv")
    sweep = sweep_table()
    for r in sweep:
        print("sweep:", r)
    write_csv(sweep, out / "day-28-sweep.csv")
    if args.no_model:
        return
    model_dir = fetch_default_model()
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    args.per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    t0 = time.perf_counter()
    rows = admission_table(model, tok, args)
    write_csv(rows, out / "day-28-admission.csv")
    old, new = rows[0], rows[1]
    print(
        f"RESULT admission preemptions={old['preemptions']}->{new['preemptions']} "
        f"immediate={old['immediate']}->{new['immediate']} "
        f"recomputed={old['recomputed_tokens']}->{new['recomputed_tokens']} "
        f"in {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
