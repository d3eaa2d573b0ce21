"""Day 22: static batching, counted. What a left-padded batch computes that nobody asked for.

The requests are `nanoserve.bench.throughput_workload`'s, cut into consecutive batches as
`bench.run_transformers_workload` cuts them. Each batch is served two static ways:

* transformers' `generate` on a left-padded batch, as `run_transformers_workload` runs it: every
  prompt padded on the left to the batch's longest, every row generating until the batch's
  longest output. Measured from the run itself: the attention mask's zeros (padded prompt
  positions), the generated length of every row (`generate`'s output minus the input width) and
  the positions each forward pass computed (a hook on the decoder).
* the engine as of day 22 (`engine_config(22)`, schedule "static"): a batch is admitted only
  into an empty engine and nobody joins until its last member has finished; prompts go in
  ragged (no padding) and a finished row leaves, so its seat idles instead of computing.
  Measured from the scheduler's choice each step.

Per batch: the padded prompt tokens, the row-steps spent after a row had its tokens (wasted by
transformers, idle in the engine), the useful tokens, and the token positions each way computed.
Both ways run on one tiny random-weight Llama (`tiny_pair`: a transformers model and the same
weights in nanoserve's `Llama`), since the counts depend only on the lengths: the workload's
lengths do not depend on the vocabulary, so the default run's counts are exactly those of
`python -m nanoserve.bench throughput` on SmolLM2 (64 requests, batches of 16). Every request's
tokens are checked three ways: padded batch, engine, and alone.

    python days/day22/staticbench.py                   # the bench's size -> day-22-static.csv
    python days/day22/staticbench.py --requests 12 --batch 4 --prompt-len 4 24 --output-len 2 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nanocourse import engine_config, same_or_near_tie, tiny_config, write_csv
from nanoserve.bench import cpu_line, run_transformers_workload, throughput_workload
from nanoserve.contiguous import NoCache
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-22-static.csv"
FULL = {"requests": 64, "prompt": (16, 256), "new": (16, 128), "batch": 16}  # the bench's defaults
SMALL = {"requests": 12, "prompt": (4, 24), "new": (2, 16), "batch": 4}  # the notebook's
PAD_ID = 0


def tiny_pair(seed: int = 0, std: float = 0.05):
    """(transformers' LlamaForCausalLM, nanoserve's Llama) on one set of random weights, shaped
    as `course.tiny_config`: 2 layers, hidden 64, vocab 256, 512 positions."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    cfg = tiny_config()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, std)
    # no end-of-sequence id: `run_transformers_workload` asks for min_new_tokens, and transformers
    # meets it by banning that id from the argmax, where nanoserve's ignore_eos picks it and goes on
    hf.generation_config.eos_token_id = None
    ours = Llama(cfg)
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours.eval()


def measure_transformers(hf, reqs, batch: int, pad_id: int = PAD_ID) -> dict:
    """Run `run_transformers_workload` and read back what it did: per batch, the input width,
    the mask's zeros, each row's generated length and the positions every forward computed;
    per request, its first max_tokens generated tokens."""
    calls, outs = [], []
    generate = hf.generate

    def recorded(*args, **kw):
        out = generate(*args, **kw)  # (B, width + longest)
        outs.append((kw["attention_mask"].clone(), out))
        return out

    def count(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)  # (B, T) of this forward pass
        calls.append(tuple(ids.shape))

    hook = hf.model.register_forward_hook(count, with_kwargs=True)
    hf.generate = recorded
    try:
        seconds, useful = run_transformers_workload(hf, reqs, batch, pad_id)
    finally:
        hook.remove()
        del hf.generate
    per_batch, tokens, k = [], [], 0
    for mask, out in outs:
        rows, width = mask.shape
        generated = [out.shape[1] - width] * rows  # every row runs as long as the batch's longest
        members = reqs[k : k + rows]
        tokens += [out[r, width : width + n].tolist() for r, (_, n) in enumerate(members)]
        per_batch.append(
            {"rows": rows, "width": width, "padded": int((mask == 0).sum()), "generated": generated}
        )
        k += rows
    positions = []  # per batch: the prefill call, then the decode calls until the next prefill
    for b, t in calls:
        if t > 1 or not positions:
            positions.append(0)
        positions[-1] += b * t
    for row, n in zip(per_batch, positions):
        row["positions"] = n
    return {"batches": per_batch, "tokens": tokens, "seconds": seconds, "useful": useful}


def static_engine(model, reqs, batch: int, block_size: int = 16) -> Engine:
    """schedule="static", `batch` rows, a pool that holds every batch (no preemption) and a step
    budget that takes a whole batch's prompts in one step, as transformers' prefill does."""
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * block_size
    longest = max(len(p) + n for p, n in reqs)
    max_len = model.cfg.max_position_embeddings
    blocks = max(batch * (-(-longest // block_size) + 1), -(-max_len // block_size)) + 1
    config = engine_config(
        22,  # the engine as of today: schedule "static", attention "gather", linear "plain"
        max_batch=batch,
        max_model_len=max_len,
        block_size=block_size,
        kv_budget=blocks * per_block + per_block // block_size,
        max_num_batched_tokens=batch * max(len(p) for p, _ in reqs),
        enable_prefix_caching=False,  # every prompt computed in full: the counts are the arithmetic's
    )
    return Engine(model, None, config)


def run_static_engine(engine: Engine, reqs) -> dict:
    """All requests queued at once, run to the end. Per step: the static batch it belongs to,
    the rows it computed, the members of its batch already finished (idle seats), its kind and
    its tokens."""
    sched, schedule = engine.scheduler, engine.scheduler.schedule
    steps, members = [], set()

    def watched():
        opens = not sched.running  # the engine is empty: a new static batch forms now
        if opens:
            members.clear()
        b = schedule()
        members.update(b.seqs)
        steps.append(
            {
                "batch": (steps[-1]["batch"] + opens) if steps else 0,
                "rows": len(b.seqs),
                "idle": sum(s.finished for s in members),
                "kind": "decode" if b.is_decode else "prefill",
                "tokens": len(b.decode) + sum(e - s for _, s, e in b.chunks),
            }
        )
        return b

    sched.schedule = watched
    ids = {
        engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)): i
        for i, (p, n) in enumerate(reqs)
    }
    out = {i: [] for i in range(len(reqs))}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[ids[o.request_id]] += o.new_token_ids
    seconds = time.perf_counter() - t0
    del sched.schedule
    return {"steps": steps, "tokens": [out[i] for i in range(len(reqs))], "seconds": seconds}


def logits_of(model, tokens: list[int]) -> torch.Tensor:
    """Every position's logits, (N, V), from nanoserve's model with no cache."""
    cache, pos = NoCache(), torch.arange(len(tokens))
    cache.begin(pos)
    return model(torch.tensor(tokens), pos, cache, logits_at=pos)


def table(hf, ours, reqs, batch: int) -> tuple[list[dict], dict, dict]:
    """The day's rows, one per batch and a total, after checking the measured counts against
    the arithmetic and every request's tokens three ways."""
    theirs = measure_transformers(hf, reqs, batch)
    engine = static_engine(ours, reqs, batch)
    mine = run_static_engine(engine, reqs)
    with torch.inference_mode():
        alone = [greedy_tokens(ours, p, n) for p, n in reqs]
    verdicts = []
    for (p, _), ref, a, b in zip(reqs, alone, theirs["tokens"], mine["tokens"]):
        verdicts.append((same_or_near_tie(ours, p, ref, a), same_or_near_tie(ours, p, ref, b)))
    rows = []
    for i, got in enumerate(theirs["batches"]):
        members = reqs[i * batch : (i + 1) * batch]
        prompts, outputs = [len(p) for p, _ in members], [n for _, n in members]
        width, longest = max(prompts), max(outputs)
        steps = [s for s in mine["steps"] if s["batch"] == i]
        row = {
            "batch": i,
            "rows": len(members),
            "prompt_tokens": sum(prompts),
            "width": width,
            "padded_prompt_tokens": sum(width - p for p in prompts),
            "longest_output": longest,
            "useful_tokens": sum(outputs),
            "wasted_row_steps": sum(longest - n for n in outputs),
            "hf_positions": len(members) * (width + longest - 1),
            "engine_positions": sum(prompts) + sum(n - 1 for n in outputs),
            "engine_steps": len(steps),
            "engine_idle_row_steps": sum(s["idle"] for s in steps),
        }
        # what the runs did, against the arithmetic
        assert got["width"] == width and got["padded"] == row["padded_prompt_tokens"], (i, got)
        assert sum(got["generated"]) - row["useful_tokens"] == row["wasted_row_steps"], (i, got)
        assert got["positions"] == row["hf_positions"], (i, got)
        assert sum(s["tokens"] for s in steps) == row["engine_positions"], i
        assert row["engine_idle_row_steps"] == row["wasted_row_steps"], i
        assert [s["kind"] for s in steps] == ["prefill"] + ["decode"] * (longest - 1), i
        rows.append(row)
    per_batch_only = ("batch", "width", "longest_output")
    total = {k: "" if k in per_batch_only else sum(r[k] for r in rows) for k in rows[0]}
    rows.append(total | {"batch": "all"})
    assert total["useful_tokens"] == theirs["useful"] == sum(len(t) for t in mine["tokens"])
    for r in rows:
        # what the engine computes is all useful: its share of what the rectangles computed
        r["useful_share"] = round(r["engine_positions"] / r["hf_positions"], 3)
    times = {"transformers_s": theirs["seconds"], "engine_s": mine["seconds"]}
    checks = {"verdicts": verdicts, "steps": mine["steps"], "theirs": theirs, "engine": engine}
    return rows, times, checks


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=FULL["requests"])
    p.add_argument("--batch", type=int, default=FULL["batch"], help="rows of a static batch")
    p.add_argument("--prompt-len", type=int, nargs=2, default=list(FULL["prompt"]), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=list(FULL["new"]), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(CSV))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    hf, ours = tiny_pair()
    reqs = throughput_workload(
        args.requests, args.prompt_len, args.output_len, ours.cfg.vocab_size, args.seed
    )
    rows, times, checks = table(hf, ours, reqs, args.batch)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    kinds = [v for pair in checks["verdicts"] for v in pair]
    print(f"tokens: {kinds.count('equal')} of {len(kinds)} equal to the request run alone, others near-ties")
    print(f"tiny model: transformers {times['transformers_s']:.2f} s, engine {times['engine_s']:.2f} s")
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()
