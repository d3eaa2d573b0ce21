"""Benchmarks that compare nanoserve with a peer in the same run (`python -m nanoserve.bench`).

    decode      batch-1 greedy decode, nanoserve against transformers' `generate` on the same
                weights, dtype and thread count; prints both rates and their ratio, and the
                bandwidth roofline (weight bytes per token against a measured read bandwidth).
    throughput  a fixed workload of many requests (random prompt and output lengths, ignore_eos):
                nanoserve's continuous batching against transformers' `generate` in static,
                left-padded batches that each run until their longest output. Useful tokens are
                the requested outputs only.
    serve       the HTTP server under load (`nanoserve.loadgen`: N concurrent streaming clients):
                TTFT, ITL and TPOT at p50/p99, tokens/s, requests/s and incomplete requests, for
                the captured-and-warmed server against an eager (--no-capture) one; then a
                warmed server against a lazily capturing one on a fresh start: the first
                request's TTFT and the stall over one long generation.
                With --url (a server already running), --nanoserve "OPTIONS" or --llama-server
                BIN (started here on the GGUF): the token workload (random token-id prompts,
                ignore_eos, greedy, one seed for every server) against each of them, one client,
                one run, one table; the last server is the base of the printed ratios.
    admission   the throughput workload under a small KV pool: admission with the watermark
                (a block kept free for every running request's next token, plus 5% of the
                pool) against the earlier policy that hands a prompt the last free blocks;
                preemptions, recomputed tokens and tokens/s of each.
    grammar     structured output at 16 rows (issue 32): a step's mask time (llguidance's fill,
                apply_mask natively and through torch, the matchers' advance) against the
                sampler's own time and a whole decode step; then 16 requests decoding together
                with none, half and all of them constrained by JSON schemas, three engines
                stepped in turn, tokens/s and the ratio, the unconstrained rows' tokens held
                equal (`bench_grammar`).

Every benchmark first prints the CPU's capability (the kernels torch picked, and whether the
CPU has bf16 instructions), since machines of one kind differ there and it moves the numbers.

Machines are shared and noisy, so no absolute number here is a promise; the ratio, measured
in one run, is the figure to quote. Each benchmark ends with one machine-readable line.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
import time
from pathlib import Path

import torch

from nanoserve.errors import NanoserveError


def write_csv(rows: list[dict], path: str | Path, cpu: bool = False) -> Path:
    """Rows to CSV; the columns are every key in order of first appearance (a row without one
    leaves it empty). `cpu=True` adds a last column, `cpu`, with `cpu_line()` on every row: a
    table of timings says which machine (and how many threads) measured it."""
    path = Path(path)
    if cpu:
        line = cpu_line()
        rows = [{**r, "cpu": line} for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    return path


def cpu_line() -> str:
    """What the CPU offers the kernels: torch's dispatch level and the bf16 instructions."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        pass
    have = [name for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if name in flags]
    return (
        f"cpu: torch capability {torch.backends.cpu.get_cpu_capability()}, flags {' '.join(have) or 'none'}, "
        f"mkldnn bf16 {'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'}, "
        f"{torch.get_num_threads()} threads"
    )


DECODE_PROMPT = "Explain, step by step, how a paged KV cache lets an inference server batch many requests."


def decode_prompt(tok) -> list[int]:
    """DECODE_PROMPT as a user's chat turn; a base model (no chat template) gets the text as is."""
    if not tok.template_source:
        return tok.encode(DECODE_PROMPT)
    return tok.encode_chat([{"role": "user", "content": DECODE_PROMPT}])


def read_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth as torch sees it: the best of a few sums over a large fp32 tensor."""
    x = torch.ones(mbytes * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_rate(run, n_tokens: int, repeats: int = 1) -> tuple[float, list[int]]:
    """Decode tokens/s of `run(n) -> tokens`, prefill removed: (n-1) / (t(n) - t(1)), t(n) the
    best of `repeats` runs (a peer measured as its best of 3 is compared with repeats=3)."""
    run(2)  # warm-up: first calls allocate and pick kernels
    t1 = min(_timed(lambda: run(1)) for _ in range(2))
    tokens: list[int] = []
    tn = _timed(lambda: tokens.extend(run(n_tokens)))
    for _ in range(repeats - 1):
        tn = min(tn, _timed(lambda: run(n_tokens)))
    return (n_tokens - 1) / max(tn - t1, 1e-9), tokens


def bench_decode(model_dir: Path, dtype: torch.dtype, n_tokens: int) -> tuple[dict, list[int]]:
    import transformers

    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine
    from nanoserve.generate import greedy_tokens
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    prompt = decode_prompt(tok)
    ours = load_model(model_dir, dtype=dtype)
    ours_rate, ours_tokens = decode_rate(lambda n: greedy_tokens(ours, prompt, n), n_tokens)
    # counted before the engine packs the matrices in place (packed ones are no longer parameters)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    # the same request through the batched engine (paged cache, scheduler, plan per step)
    engine = Engine(ours, tok, EngineConfig(max_batch=1))
    engine_rate, engine_tokens = decode_rate(lambda n: engine_tokens_of(engine, prompt, n), n_tokens)
    engine = None
    fused_rate, fused_same = None, None
    if dtype == torch.float32:  # the whole step in one native call, on the weights as loaded
        plain = load_model(model_dir, dtype=dtype)
        if plain.fused_status() is None:
            fused = Engine(plain, tok, EngineConfig(max_batch=1, decode_step="fused"))
            fused_rate, fused_tokens = decode_rate(lambda n: engine_tokens_of(fused, prompt, n), n_tokens)
            fused_same = agreement(fused_tokens, ours_tokens)
        plain = fused = None
    ours = None  # free its memory before loading the peer

    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor([prompt])

    def hf_run(n: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=min(tok.eos_ids),
            )
        return out[0, len(prompt) :].tolist()

    hf_rate, hf_tokens = decode_rate(hf_run, n_tokens)
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), None)
    assert engine_tokens == ours_tokens, "the engine's greedy tokens differ from the eager path's"
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "tokens": n_tokens,
        "nanoserve_tok_s": round(ours_rate, 1),
        "engine_tok_s": round(engine_rate, 1),
        "transformers_tok_s": round(hf_rate, 1),
        "ratio": round(ours_rate / hf_rate, 2),
        "fused_tok_s": None if fused_rate is None else round(fused_rate, 1),
        "fused_ratio": None if fused_rate is None else round(fused_rate / hf_rate, 2),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "first_token_difference": "none" if same is None else same,
        "fused_vs_eager": "n/a" if fused_rate is None else fused_same,
    }, ours_tokens


def engine_tokens_of(engine, prompt: list[int], n: int) -> list[int]:
    from nanoserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return engine.generate([prompt], params, use_tqdm=False)[0].token_ids


def scores_at(engine, prompt: list[int], prefix: list[int], tokens: tuple[int, ...], top: int = 20) -> list:
    """Our log-probabilities of `tokens` for the position after prompt + prefix (None for one
    outside our top `top`): where a peer's greedy tokens part from ours, whether that position was
    a near tie for us or a token we rank far below."""
    from nanoserve.sampling import SamplingParams

    engine.add_request(prompt + prefix, SamplingParams(max_tokens=1, logprobs=top))
    ranked: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.logprobs:
                ranked = dict(out.logprobs[0].top)
    return [ranked.get(t) for t in tokens]


def describe_difference(engine, prompt: list[int], ours: list[int], theirs: list[int]) -> str:
    """'equal', or where two greedy continuations part and how far apart the two tokens were in
    our own scores there, e.g. 'differ at 0 (ours 49 -1.383, theirs 2427 -1.527)'."""
    d = first_difference(ours, theirs)
    if d is None:
        return "equal"
    if d >= min(len(ours), len(theirs)):
        return f"differ at {d} (one is shorter)"
    a, b = ours[d], theirs[d]
    la, lb = scores_at(engine, prompt, ours[:d], (a, b))
    theirs_score = f"{lb:.3f}" if lb is not None else "outside our top 20"
    return f"differ at {d} (ours {a} {la:.3f}, theirs {b} {theirs_score})"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists part (or the shorter one's end), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(a: list, b: list) -> str:
    """How two token lists compare, as the benchmarks' tables write it: 'equal', or 'differ at N'
    with N where they first part (`first_difference`)."""
    d = first_difference(a, b)
    return "equal" if d is None else f"differ at {d}"


def decode_turns(engines: dict, prompt: list[int], n_tokens: int, reps: int) -> tuple[dict, dict]:
    """Batch-1 decode of `prompt` by several engines taking turns, `reps` turns each, so that a
    noisy stretch of the machine falls on all of them: ({key: best rate (`decode_rate`)}, {key:
    greedy tokens}); an engine whose tokens change from one turn to the next fails."""
    best: dict = {}
    tokens: dict = {}
    for _ in range(reps):
        for key, eng in engines.items():
            rate, toks = decode_rate(lambda n, e=eng: engine_tokens_of(e, prompt, n), n_tokens)
            best[key] = max(best.get(key, 0.0), rate)
            assert tokens.setdefault(key, toks) == toks, f"{key} gave other tokens on another turn"
    return best, tokens


def bench_decode_quant(model_dir: Path, gguf: Path, weights: str, activations: str, n_tokens: int, reference):
    """Batch-1 decode from the GGUF's own blocks: the fused step and the same engine on torch
    ops, their tokens against each other and against the fp32 reference's."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine
    from nanoserve.models import LlamaConfig, load_gguf_model, model_weight_bytes
    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    prompt = decode_prompt(tok)
    model = load_gguf_model(gguf, LlamaConfig.from_dir(model_dir), weights, activations)
    rates, tokens, runs, engines = {}, {}, {}, {}
    # a model the fused step cannot run (fused_status says why) is measured on ops alone, said in the row
    steps = ("fused", "ops") if model.fused_status() is None else ("ops",)
    for step in steps:
        eng = engines[step] = Engine(
            model, tok, EngineConfig(max_batch=1, decode_step=step, fit_context=True)
        )
        runs[step] = lambda n, e=eng: engine_tokens_of(e, prompt, n)
        rates[step], tokens[step] = decode_rate(runs[step], n_tokens, 3)
    main = steps[0]
    ref_diff = agreement(tokens[main], reference) if reference else "n/a"
    return (
        {
            "weights": f"{weights}/{activations}",
            "threads": torch.get_num_threads(),
            "tokens": n_tokens,
            "fused_tok_s": round(rates["fused"], 1) if "fused" in rates else "n/a",
            "ops_tok_s": round(rates["ops"], 1),
            "weight_mb": round(model_weight_bytes(model) / 1e6, 1),
            "fused_vs_ops": agreement(tokens["fused"], tokens["ops"]) if "fused" in tokens else "n/a",
            "vs_fp32_reference": ref_diff,
        },
        tokens[main],
        prompt,
        lambda: decode_rate(runs[main], n_tokens)[0],  # the engine's rate once more, for interleaving
        engines[main],
    )


def llama_server_decode(
    binary: str, gguf: Path, prompt: list[int], n_tokens: int, threads: int, between=None
):
    """llama.cpp's own decode rate on the same prompt and GGUF: `llama-server` started here,
    greedy, n tokens past EOS; its `timings.predicted_per_second` (prefill excluded), best of 3.
    `between()`, when given, runs before each request: our own timed run, so that the two
    engines alternate and a noisy stretch of a shared machine falls on both."""
    import httpx

    with PeerProcess(binary, str(gguf), _free_port(), slots=1, ctx=4096, threads=threads) as peer:
        best, toks = 0.0, []
        for _ in range(3):
            if between is not None:
                between()
            r = httpx.post(
                f"{peer.url}/completion",
                json={
                    "prompt": prompt,
                    "n_predict": n_tokens,
                    "temperature": 0,
                    "top_k": 1,
                    "ignore_eos": True,
                    "cache_prompt": False,
                    "return_tokens": True,
                },
                timeout=300,
            ).json()
            best = max(best, float(r["timings"]["predicted_per_second"]))
            toks = r.get("tokens") or []
    return best, toks


def llama_bench_decode(binary: str, gguf: Path, n_tokens: int, threads: int, between=None) -> float:
    """llama.cpp's `llama-bench -p 0 -n N`: tokens/s generating N tokens from an empty context,
    the best of 3 runs; `between()`, when given, runs before each (as in `llama_server_decode`)."""
    import json
    import subprocess

    best = 0.0
    for _ in range(3):
        if between is not None:
            between()
        out = subprocess.run(
            [binary, "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n_tokens), "-r", "1"]
            + ["-o", "json"],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
        best = max(best, float(next(r["avg_ts"] for r in json.loads(out) if r.get("n_gen"))))
    return best


def throughput_workload(n: int, prompt_lens, output_lens, vocab: int, seed: int = 0):
    """n (prompt_ids, max_tokens) pairs, lengths uniform in the given inclusive ranges."""
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(n):
        p = int(torch.randint(prompt_lens[0], prompt_lens[1] + 1, (1,), generator=g))
        o = int(torch.randint(output_lens[0], output_lens[1] + 1, (1,), generator=g))
        # ids from the ordinary vocabulary: SmolLM2's first ids are special tokens
        reqs.append((torch.randint(100, vocab, (p,), generator=g).tolist(), o))
    return reqs


def run_nanoserve_workload(
    model, tokenizer, reqs, config, engine_out: list | None = None
) -> tuple[float, int, int]:
    """(seconds, useful tokens, preemptions) for the workload on a fresh engine (appended to
    engine_out when given, for a caller that wants more of its counts)."""
    from nanoserve.engine import Engine
    from nanoserve.sampling import SamplingParams

    engine = Engine(model, tokenizer, config)
    if engine_out is not None:
        engine_out.append(engine)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in reqs]
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == [o for _, o in reqs], "a request did not get its tokens"
    return dt, sum(len(o.token_ids) for o in outs), engine.scheduler.num_preemptions


def run_transformers_workload(hf, reqs, batch: int, pad_id: int) -> tuple[float, int]:
    """(seconds, useful tokens): static batches, left-padded, each until its longest output."""
    t0, useful = time.perf_counter(), 0
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i : i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), pad_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (p, _) in enumerate(chunk):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            longest = max(o for _, o in chunk)
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
            useful += sum(o for _, o in chunk)
    return time.perf_counter() - t0, useful


def cmd_throughput(args) -> None:
    import transformers

    from nanoserve.config import EngineConfig
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = resolve_model_dir(args.model)
    tok = Tokenizer.from_dir(model_dir)
    dtypes = {"float32": ["float32"], "bfloat16": ["bfloat16"], "both": ["float32", "bfloat16"]}[args.dtype]
    print(
        f"model {model_dir.name}, {torch.get_num_threads()} threads, {args.requests} requests, "
        f"prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"outputs {args.output_len[0]}-{args.output_len[1]} tokens, "
        f"nanoserve max_batch {args.max_batch}, transformers static batches of {args.hf_batch}"
    )
    rows = []
    for dtype in dtypes:
        model = load_model(model_dir, dtype=getattr(torch, dtype))
        reqs = throughput_workload(
            args.requests, args.prompt_len, args.output_len, model.cfg.vocab_size, args.seed
        )
        config = EngineConfig(
            dtype=dtype, max_batch=args.max_batch, max_num_batched_tokens=args.batched_tokens
        )
        ours_s, useful, preemptions = run_nanoserve_workload(model, tok, reqs, config)
        model = None
        hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        hf_s, hf_useful = run_transformers_workload(hf, reqs, args.hf_batch, min(tok.eos_ids))
        hf = None
        row = {
            "dtype": dtype,
            "requests": len(reqs),
            "useful_tokens": useful,
            "nanoserve_s": round(ours_s, 1),
            "nanoserve_tok_s": round(useful / ours_s, 1),
            "transformers_s": round(hf_s, 1),
            "transformers_tok_s": round(hf_useful / hf_s, 1),
            "ratio": round((useful / ours_s) / (hf_useful / hf_s), 2),
            "preemptions": preemptions,
        }
        rows.append(row)
        print(
            f"{dtype:>9}: nanoserve {row['nanoserve_tok_s']:6.1f} tok/s ({row['nanoserve_s']} s)   "
            f"transformers {row['transformers_tok_s']:6.1f} tok/s ({row['transformers_s']} s)   "
            f"ratio {row['ratio']:.2f}x   "
            f"{useful} useful tokens, {preemptions} preemptions"
        )
    finish("throughput", rows, args.csv)


def cmd_admission(args) -> None:
    from nanoserve.config import EngineConfig
    from nanoserve.models import load_model
    from nanoserve.pool import parse_bytes
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    reqs = throughput_workload(
        args.requests, args.prompt_len, args.output_len, model.cfg.vocab_size, args.seed
    )
    budget = parse_bytes(args.kv_budget)
    rows = []
    for name, watermark in (("last free blocks", None), ("watermark", args.watermark)):
        config = EngineConfig(
            schedule=args.schedule,
            max_batch=args.max_batch,
            max_model_len=args.max_model_len,
            kv_budget=budget,
            watermark=watermark,
        )
        engines: list = []
        seconds, useful, preemptions = run_nanoserve_workload(model, tok, reqs, config, engines)
        rows.append(
            {
                "policy": name,
                "watermark": "none" if watermark is None else watermark,
                "kv_blocks": engines[0].pool.num_blocks,
                "preemptions": preemptions,
                "recomputed_tokens": engines[0].scheduler.recomputed_tokens,
                "useful_tokens": useful,
                "seconds": round(seconds, 1),
                "tok_s": round(useful / seconds, 1),
            }
        )
        r = rows[-1]
        print(
            f"{name:>16}: {r['preemptions']:4d} preemptions, {r['recomputed_tokens']:6d} tokens recomputed, "
            f"{r['tok_s']:6.1f} tok/s ({r['seconds']} s) over {r['kv_blocks']} blocks"
        )
    if args.csv:
        write_csv(rows, args.csv, cpu=True)
    old, new = rows
    print(
        f"RESULT admission preemptions={old['preemptions']}->{new['preemptions']} "
        f"recomputed={old['recomputed_tokens']}->{new['recomputed_tokens']} "
        f"tok_s={old['tok_s']}->{new['tok_s']} ratio={new['tok_s'] / old['tok_s']:.2f}x"
    )


def finish(bench: str, rows: list[dict], csv_path: str | None) -> None:
    """Write the rows when asked, and end with the one machine-readable line."""
    if csv_path:
        write_csv(rows, csv_path, cpu=True)
    ratios = " ".join(
        f"{r['dtype']}={r['nanoserve_tok_s']}/{r['transformers_tok_s']}={r['ratio']}x" for r in rows
    )
    print(f"RESULT {bench} {ratios}")


def cmd_decode(args) -> None:
    from nanoserve.weights import fetch_default_gguf, resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = resolve_model_dir(args.model)
    dtypes = {
        "float32": [torch.float32],
        "bfloat16": [torch.bfloat16],
        "both": [torch.float32, torch.bfloat16],
        "none": [],
    }
    bandwidth = read_bandwidth_gbs()
    threads = torch.get_num_threads()
    print(f"model {model_dir.name}, {threads} threads, read bandwidth {bandwidth:.1f} GB/s")
    rows, reference = [], None
    for dtype in dtypes[args.dtype]:
        row, tokens = bench_decode(model_dir, dtype, args.tokens)
        if dtype == torch.float32:
            reference = tokens  # the fp32 model's eager greedy tokens, which the q4_1 rows are held to
        row["roofline_tok_s"] = round(bandwidth * 1e9 / (row["weight_mb"] * 1e6), 1)
        rows.append(row)
        fused = (
            f"   fused step {row['fused_tok_s']:.1f} tok/s ({row['fused_ratio']:.2f}x, tokens "
            f"{row['fused_vs_eager']})"
            if row["fused_tok_s"] is not None
            else ""
        )
        print(
            f"{row['dtype']:>9}: nanoserve {row['nanoserve_tok_s']:6.1f} tok/s (engine "
            f"{row['engine_tok_s']:.1f})   transformers "
            f"{row['transformers_tok_s']:6.1f} tok/s   ratio {row['ratio']:.2f}x{fused}   roofline "
            f"{row['roofline_tok_s']:.1f} tok/s ({row['weight_mb']:.0f} MB a token)   "
            f"greedy tokens differ at: {row['first_token_difference']}"
        )
    if args.quant and reference is None:  # the fp32 model's greedy tokens, the q4_1/fp32 rows' reference
        from nanoserve.generate import greedy_tokens
        from nanoserve.models import load_model
        from nanoserve.tokenizer import Tokenizer

        prompt = decode_prompt(Tokenizer.from_dir(model_dir))
        reference = greedy_tokens(load_model(model_dir), prompt, args.tokens)
    quant_rows = []
    gguf = Path(args.gguf) if args.gguf else (fetch_default_gguf() if args.model is None else None)
    if args.quant and gguf is None:
        print("quantized rows: pass --gguf FILE (the GGUF this model directory came from)")
    for spec in args.quant if gguf is not None else []:
        weights, _, acts = spec.partition("/")
        row, tokens, prompt, again, engine = bench_decode_quant(
            model_dir, gguf, weights, acts or "fp32", args.tokens, reference
        )
        row["roofline_tok_s"] = round(bandwidth * 1e9 / (row["weight_mb"] * 1e6), 1)
        # llama.cpp's rates, each of its 3 runs following one run of ours, so that a slow stretch
        # of a shared machine falls on both; a ratio is the best of ours against its best.
        peer = {}
        for name, binary in (("llama-server", args.llama_server), ("llama-bench", args.llama_bench)):
            if not binary:
                continue
            ours: list[float] = []
            between = lambda ours=ours, again=again: ours.append(again())  # noqa: E731
            if name == "llama-server":
                rate, peer_tokens = llama_server_decode(binary, gguf, prompt, args.tokens, threads, between)
            else:
                rate, peer_tokens = llama_bench_decode(binary, gguf, args.tokens, threads, between), None
            peer[name] = (rate, peer_tokens)
            row[f"{name}_tok_s"] = round(rate, 1)
            row[f"fused_tok_s_with_{name}"] = round(max(ours), 1)
            row[f"ratio_vs_{name}"] = round(max(ours) / rate, 2)
            if peer_tokens:
                # int8 activations round each block of 32 to a scale: a change in the 6th digit
                # anywhere moves some roundings, and a near tie can go either way (llama.cpp's
                # q8_1 activations round as ours do); so a difference comes with both scores
                row[f"vs_{name}_tokens"] = describe_difference(engine, prompt, tokens, peer_tokens)
        quant_rows.append(row)
        peers = "".join(
            f"   {name} {rate:.1f} tok/s against our {row[f'fused_tok_s_with_{name}']:.1f} alternating "
            f"(ratio {row[f'ratio_vs_{name}']:.2f}x"
            + (f", tokens {row[f'vs_{name}_tokens']}" if f"vs_{name}_tokens" in row else "")
            + ")"
            for name, (rate, _) in peer.items()
        )
        print(
            f"{row['weights']:>10}: fused step {row['fused_tok_s']:>6} tok/s   torch ops "
            f"{row['ops_tok_s']:.1f}{peers}   roofline {row['roofline_tok_s']:.1f} tok/s "
            f"({row['weight_mb']:.0f} MB a token)   fused vs ops tokens {row['fused_vs_ops']}, "
            f"vs the fp32 model {row['vs_fp32_reference']}"
        )
    if args.csv:
        write_csv(rows + quant_rows, args.csv, cpu=True)
    ratios = " ".join(
        f"{r['dtype']}={r['nanoserve_tok_s']}/{r['transformers_tok_s']}={r['ratio']}x"
        + (
            f" {r['dtype']}_fused={r['fused_tok_s']}/{r['transformers_tok_s']}={r['fused_ratio']}x"
            if r["fused_tok_s"]
            else ""
        )
        for r in rows
    )
    for r in quant_rows:
        ratios += f" {r['weights']}={r['fused_tok_s']}"
        for name in ("llama-server", "llama-bench"):
            if f"{name}_tok_s" in r:
                ours = r[f"fused_tok_s_with_{name}"]
                ratios += f" {ours}/{name}:{r[f'{name}_tok_s']}={r[f'ratio_vs_{name}']}x"
    print(f"RESULT decode {ratios.strip()}")


class ServerProcess:
    """`nanoserve serve` in a child process, waited on until /health says 200."""

    def __init__(self, args: list[str], port: int, threads: int | None = None):
        import subprocess

        cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--port", str(port), *args]
        if threads:
            cmd += ["--threads", str(threads)]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.boot = ""

    def __enter__(self):
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    self.health = r.json()
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not become healthy in 600 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=30)
        except Exception:
            self.proc.kill()
            err = ""
        self.boot = next((ln for ln in (err or "").splitlines() if "listening on" in ln), "")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_serve(args) -> None:
    import asyncio

    from nanoserve.loadgen import LoadRequest, chat_workload, run_load, stall_seconds_observed, summarize

    # --weights dtype by default: capture and the warm list run on the converted model, and a CPU
    # server otherwise serves the GGUF's own blocks, which decode eagerly (cli.decode_capture), so
    # both rows would be the same eager server
    common = ["--max-batch", str(args.max_batch), "--weights", args.weights]
    common += ["--model", args.model] if args.model else []
    reqs = chat_workload(args.requests, args.max_tokens)
    print(cpu_line())
    print(
        f"{args.requests} streaming chat requests of {args.max_tokens} tokens (ignore_eos, greedy), "
        f"{args.clients} concurrent clients, server max_batch {args.max_batch}"
    )
    rows = []
    for name, flags in (("captured+warm", []), ("eager", ["--no-capture"])):
        with ServerProcess(common + flags, _free_port(), args.threads) as srv:
            asyncio.run(run_load(srv.url, reqs[: args.clients], args.clients))  # one round to settle
            row = {"server": name} | summarize(asyncio.run(run_load(srv.url, reqs, args.clients)))
            row["warm_graphs"] = (srv.health.get("warm") or {}).get("graphs", 0)  # 0: nothing captured
        rows.append(row)
        print(
            f"{name:>14}: {row['output_tok_s']:6.1f} tok/s  {row['req_s']:.2f} req/s  "
            f"TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms  "
            f"ITL p50 {row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms  "
            f"TPOT p50 {row['tpot_p50_ms']:.1f} ms p99 {row['tpot_p99_ms']:.1f} ms  "
            f"incomplete {row['incomplete']}"
        )
    print(f"captured+warm / eager throughput: {rows[0]['output_tok_s'] / rows[1]['output_tok_s']:.2f}x")

    # warm against lazy, each on a fresh server: the first request after boot, one long generation
    long = [LoadRequest([{"role": "user", "content": "Tell me a long story about a lighthouse."}], args.long)]
    width = str(max(256, args.long + 64))
    stalls = []
    for name, flags in (("warm", ["--warm-max-width", width]), ("lazy", ["--no-warm"])):
        with ServerProcess(common + ["--max-batch", "1"] + flags, _free_port(), args.threads) as srv:
            res = asyncio.run(run_load(srv.url, long, 1)).results[0]
            warm = srv.health.get("warm") or {}
        row = {
            "server": name,
            "warm_graphs": warm.get("graphs", 0),
            "warm_seconds": warm.get("seconds", 0.0),
            "first_ttft_ms": round(1000 * res.ttft, 1) if res.ttft is not None else None,
            "stall_ms": round(1000 * stall_seconds_observed(res.itls), 1),
            "itl_max_ms": round(1000 * max(res.itls), 1) if res.itls else None,
            "tokens": res.tokens,
            "complete": res.complete,
        }
        stalls.append(row)
        print(
            f"{name:>5}: warm list {row['warm_graphs']} graphs in {row['warm_seconds']:.2f} s; "
            f"first request: TTFT {row['first_ttft_ms']} ms, {row['tokens']} tokens, "
            f"stall {row['stall_ms']} ms (worst gap {row['itl_max_ms']} ms)"
        )
    if args.csv:
        write_csv(rows, args.csv, cpu=True)
        write_csv(stalls, Path(args.csv).with_name(Path(args.csv).stem + "-warm.csv"), cpu=True)
    print(
        f"RESULT serve captured={rows[0]['output_tok_s']}/eager={rows[1]['output_tok_s']} "
        f"incomplete={rows[0]['incomplete'] + rows[1]['incomplete']} "
        f"first_ttft_ms warm={stalls[0]['first_ttft_ms']} lazy={stalls[1]['first_ttft_ms']} "
        f"stall_ms warm={stalls[0]['stall_ms']} lazy={stalls[1]['stall_ms']}"
    )


class PeerProcess:
    """llama.cpp's `llama-server` in a child process (a measurement, never a dependency), waited
    on until its /health answers 200."""

    def __init__(self, binary: str, gguf: str, port: int, slots: int, ctx: int, threads: int, extra=()):
        import subprocess

        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots)]
        cmd += ["-c", str(ctx), "-t", str(threads), "-tb", str(threads), *extra]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    __enter__ = ServerProcess.__enter__

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=30)
        except Exception:
            self.proc.kill()


def serve_row(name: str, url: str, reqs, clients: int, settle) -> dict:
    import asyncio

    from nanoserve.loadgen import run_load, summarize

    asyncio.run(run_load(url, settle, clients))  # one round first: connections, allocations, lazy setup
    return {"server": name, "url": url} | summarize(asyncio.run(run_load(url, reqs, clients)))


def print_serve_table(rows: list[dict]) -> None:
    print("\n| server | out tok/s | TTFT p50 / p99 | inter-token p50 / p99 | incomplete |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['server']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms'] / 1000:.2f} / "
            f"{r['ttft_p99_ms'] / 1000:.2f} s | {r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} ms | "
            f"{r['incomplete']} |"
        )
    if len(rows) > 1:
        base = rows[-1]
        for r in rows[:-1]:
            print(
                f"{r['server']} / {base['server']}: "
                f"output tok/s {r['output_tok_s'] / base['output_tok_s']:.2f}x, "
                f"TTFT p99 {r['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x, "
                f"inter-token p99 {r['itl_p99_ms'] / base['itl_p99_ms']:.2f}x"
            )


def cmd_peers(args) -> None:
    """The token workload against servers already running (--url) and/or ones this starts:
    nanoserve (`--nanoserve "ARGS"`) and llama.cpp's server (`--llama-server BIN`), one client,
    one run, the same requests."""
    from nanoserve.loadgen import token_workload

    seed = args.seed if args.seed is not None else int(time.time())
    reqs = token_workload(args.requests, args.prompt_len, args.output_len, args.vocab, seed)
    settle = token_workload(args.clients, args.prompt_len, args.output_len, args.vocab, seed + 1)
    print(cpu_line())
    print(
        f"workload (seed {seed}): {args.requests} streamed completions of random token ids, prompts "
        f"U{list(args.prompt_len)} tokens, max_tokens U{list(args.output_len)}, ignore_eos, greedy, "
        f"{args.clients} concurrent clients over keep-alive connections"
    )
    rows = []
    for spec in args.url or []:
        name, _, url = spec.rpartition("=")
        rows.append(serve_row(name or url, url, reqs, args.clients, settle))
    for flags in args.nanoserve or []:
        extra = flags.split()
        with ServerProcess(extra, _free_port(), args.threads) as srv:
            rows.append(serve_row(f"nanoserve {flags}".strip(), srv.url, reqs, args.clients, settle))
    if args.llama_server:
        from nanoserve.weights import fetch_default_gguf

        gguf = args.gguf or str(fetch_default_gguf())
        with PeerProcess(
            args.llama_server, gguf, _free_port(), args.clients, args.ctx, args.threads or 2
        ) as srv:
            name = f"llama-server -np {args.clients} -c {args.ctx} -t {args.threads or 2}"
            rows.append(serve_row(name, srv.url, reqs, args.clients, settle))
    if not rows:
        raise SystemExit("nothing to measure: give --url, --nanoserve or --llama-server")
    print_serve_table(rows)
    if args.csv:
        write_csv([r | {"seed": seed} for r in rows], args.csv, cpu=True)


TP_SHARE = re.compile(
    r"tensor parallel rank (\d+)/(\d+): .*weights ([\d.]+) MB, KV pool ([\d.]+) MB \(([\d,]+) tokens\)"
)
TP_RATE = re.compile(r"(\d+) generated, first token ([\d.]+) s, decode ([\d.]+) tok/s")


def tp_generate(ranks: int, args: list[str], timeout: float = 600) -> tuple[str, list[dict], dict]:
    """`python -m nanoserve generate ARGS` as `ranks` processes (tp.spawn): rank 0's text, every
    rank's share as rank 0 prints it, and rank 0's rate line."""
    import subprocess

    from nanoserve.tp import spawn

    procs = spawn(
        ranks,
        ["-m", "nanoserve", "generate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    outs = [p.communicate(timeout=timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise NanoserveError(f"a rank failed: {[o[1].strip().splitlines()[-1:] for o in outs]}")
    err = outs[0][1]
    shares = [
        {
            "rank": int(m[0]),
            "weight_mb": float(m[2]),
            "kv_pool_mb": float(m[3]),
            "kv_tokens": int(m[4].replace(",", "")),
        }
        for m in TP_SHARE.findall(err)
    ]
    rate = TP_RATE.search(err)
    return outs[0][0].rstrip("\n"), shares, {"generated": int(rate[1]), "decode_tok_s": float(rate[3])}


def cmd_tp(args) -> None:
    """Memory a rank holds under tensor parallelism against one process: weights and KV pool."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import build_engine
    from nanoserve.models import LlamaConfig, model_weight_bytes
    from nanoserve.tp import allowed_ranks, pool_bytes
    from nanoserve.weights import resolve_model_dir

    torch.set_num_threads(1)
    print(cpu_line())
    model_dir = resolve_model_dir(args.model)
    counts = args.ranks or [n for n in allowed_ranks(LlamaConfig.from_dir(model_dir)) if n > 1]
    # the fp32 weights in one process too (its default would be the GGUF): the model the ranks split
    gen = [
        args.prompt,
        "--max-tokens",
        str(args.tokens),
        "--ignore-eos",
        "--threads",
        "1",
        "--weights",
        "dtype",
    ]
    gen += ["--model", str(model_dir)] if args.model else []
    # one process, the same command: its text and rate; its weights and pool measured here
    text, _, rate = tp_generate(1, gen)
    engine = build_engine(EngineConfig(model=args.model, max_batch=1, threads=1))
    one = (
        {
            "ranks": 1,
            "rank": 0,
            "weight_mb": round(model_weight_bytes(engine.model) / 1e6, 1),
            "kv_pool_mb": round(pool_bytes(engine.model, engine.pool.num_slots) / 1e6, 1),
            "kv_tokens": engine.pool.num_slots,
        }
        | rate
        | {"text_equal": True}
    )
    engine = None
    rows = [one]
    print(f"model {model_dir.name}: rank counts it allows {allowed_ranks(LlamaConfig.from_dir(model_dir))}")
    print(
        f"  1 process : weights {one['weight_mb']:.1f} MB, KV pool {one['kv_pool_mb']:.1f} MB "
        f"({one['kv_tokens']:,} tokens), decode {one['decode_tok_s']:.1f} tok/s"
    )
    for n in counts:
        got, shares, rate = tp_generate(n, gen)
        for sh in shares:
            rows.append({"ranks": n} | sh | rate | {"text_equal": got == text})
        w = max(sh["weight_mb"] for sh in shares)
        kv = max(sh["kv_pool_mb"] for sh in shares)
        print(
            f"  {n} ranks   : weights {w:.1f} MB a rank ({w / one['weight_mb']:.2f}x one process), "
            f"KV pool {kv:.1f} MB a rank ({kv / one['kv_pool_mb']:.2f}x) for the same "
            f"{shares[0]['kv_tokens']:,} tokens, decode {rate['decode_tok_s']:.1f} tok/s "
            f"({rate['decode_tok_s'] / one['decode_tok_s']:.2f}x), text "
            f"{'equal' if got == text else 'differs'}"
        )
    if args.csv:
        write_csv(rows, args.csv, cpu=True)
    print(
        "RESULT tp "
        + " ".join(f"{r['ranks']}r{r['rank']}:w={r['weight_mb']}MB,kv={r['kv_pool_mb']}MB" for r in rows)
    )


# --- grammar: the per-step cost of structured output (issue 32) -----------------------------------


def _grammar_schemas(items: int) -> list[tuple[str, str, dict]]:
    """(name, what the prompt asks for, schema): eight JSON schemas of different shapes, each an
    array (or an object around one) of at least `items` items, so that no answer fits in
    `items` tokens (every item takes a token at least) and a constrained row's grammar is still
    open at its last step (`bench_grammar` counts the rows where it was not)."""

    def obj(props: dict) -> dict:
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    def array(item: dict) -> dict:
        return {"type": "array", "items": item, "minItems": items}

    string, integer, number = {"type": "string"}, {"type": "integer"}, {"type": "number"}
    return [
        (
            "people",
            "people",
            array(
                obj({"name": {**string, "maxLength": 24}, "age": {**integer, "minimum": 0, "maximum": 120}})
            ),
        ),
        ("points", "points on a map", array(obj({"x": number, "y": number}))),
        (
            "inventory",
            "a shop's inventory",
            obj(
                {
                    "store": {**string, "maxLength": 30},
                    "items": array(
                        obj(
                            {
                                "sku": {**string, "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                "qty": {**integer, "minimum": 1, "maximum": 99},
                                "price": {**number, "minimum": 0},
                            }
                        )
                    ),
                }
            ),
        ),
        ("colors", "colors", array({"enum": ["red", "green", "blue", "yellow", "purple"]})),
        (
            "log",
            "log entries",
            array(
                obj(
                    {
                        "level": {"enum": ["debug", "info", "warn", "error"]},
                        "code": integer,
                        "msg": {**string, "maxLength": 40},
                    }
                )
            ),
        ),
        (
            "matrix",
            "rows of a matrix",
            array({"type": "array", "items": integer, "minItems": 3, "maxItems": 3}),
        ),
        (
            "flags",
            "feature flags",
            array(obj({"enabled": {"type": "boolean"}, "retries": {**integer, "minimum": 0, "maximum": 5}})),
        ),
        ("words", "words", array({**string, "maxLength": 12})),
    ]


GRAMMAR_TOPICS = ("for a small town", "for a space station")


def _stats_us(seconds: list[float], rows: int) -> dict:
    """Median and p90 (nearest rank) in µs, and the same divided by `rows`."""
    import math
    import statistics

    s = sorted(seconds)
    med, p90 = statistics.median(s) * 1e6, s[max(0, math.ceil(0.9 * len(s)) - 1)] * 1e6
    return {
        "median_us": round(med, 1),
        "p90_us": round(p90, 1),
        "per_row_median_us": round(med / rows, 1),
        "per_row_p90_us": round(p90 / rows, 1),
        "samples": len(s),
    }


def _grammar_runs(engines: dict, prompts, guided: dict, tokens: int) -> dict[str, dict]:
    """One batch on each engine (run name -> engine; `guided[name]`: each row's grammar or
    None): every prompt at once, greedy, `tokens` tokens each (ignore_eos). The engines step in
    lockstep, one step each in turn (the order reversed every other round), so a busy stretch of a
    shared machine falls on every run alike. For each run: its time (the sum of its own steps),
    each pure decode step's time, every row's tokens, and how many grammar rows took the end
    token before their last step (their grammar complete)."""
    from nanoserve.sampling import SamplingParams

    state = {}
    for name, engine in engines.items():
        ids, seqs = [], []
        for p, g in zip(prompts, guided[name]):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, guided=g)
            ids.append(engine.add_request(p, params))
            seqs.append(engine.requests[ids[-1]].seq)
        state[name] = {"ids": ids, "seqs": seqs, "got": {rid: [] for rid in ids}, "busy": 0.0, "decode": []}
    order, round_ = list(engines), 0
    while any(e.has_unfinished() for e in engines.values()):
        for name in order if round_ % 2 == 0 else order[::-1]:
            engine, st = engines[name], state[name]
            if not engine.has_unfinished():
                continue
            before = engine.step_kinds["decode"]
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            st["busy"] += dt
            if engine.step_kinds["decode"] > before:
                st["decode"].append(dt)
            for out in outs:
                if out.finish_reason == "error":
                    raise NanoserveError(f"request {out.request_id} failed: {out.error}")
                st["got"][out.request_id].extend(out.new_token_ids)
        round_ += 1
    runs = {}
    for name, st in state.items():
        tokens_of = [st["got"][rid] for rid in st["ids"]]
        if any(len(t) != tokens for t in tokens_of):
            raise NanoserveError("a request did not get its tokens")
        n = sum(len(t) for t in tokens_of)
        runs[name] = {
            "seconds": st["busy"],
            "tokens": n,
            "tok_s": n / st["busy"],
            "decode_steps": st["decode"],
            "decode_tok_s": len(prompts) * len(st["decode"]) / max(sum(st["decode"]), 1e-9),
            "token_ids": tokens_of,
            "completed_early": sum(1 for q in st["seqs"] if q.matcher is not None and q.matcher.is_stopped()),
        }
    return runs


def _mask_replay(engine, guided, token_ids, steps: int) -> tuple[dict, bool]:
    """Time, step by step, what a step spends on its grammar rows (one per entry of `guided`,
    advanced along `token_ids`, what the engine generated under that grammar; a row at its end
    token or its last token starts over with a fresh matcher, untimed): `Grammars.fill`,
    `apply_mask` with the native kernel and with the torch fallback, the matchers' advance;
    and the sampler for the same rows, without masks (greedy: the engine's call when no row
    has a grammar) and with them. Returns {name: seconds a step} and whether the two apply
    paths wrote the same logits at every step."""
    from unittest import mock

    import nanoserve.kernels as kernels
    from nanoserve.grammar import apply_mask
    from nanoserve.sampling import SamplingParams, sample_rows

    g = engine.grammars
    rows, vocab = len(guided), engine.model.cfg.vocab_size
    eos = engine.eos_ids
    # each row's answer up to and with its first end token (after it, ignore_eos repeats the end)
    answers = []
    for ids in token_ids:
        end = next((i for i, t in enumerate(ids) if t in eos), None)
        answers.append(ids if end is None else ids[: end + 1])
    matchers = [g.matcher(x) for x in guided]
    at = [0] * rows
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    params, generators = [SamplingParams() for _ in range(rows)], [None] * rows
    history = [([1], 1)] * rows
    index = list(range(rows))
    times: dict[str, list[float]] = {
        k: [] for k in ("fill", "apply_native", "apply_torch", "advance", "sampler", "sampler_masked")
    }
    same = True
    for step in range(steps + 2):  # the first two warm the paths and are not counted
        for i in range(rows):
            if at[i] >= len(answers[i]) or matchers[i].is_stopped():
                matchers[i], at[i] = g.matcher(guided[i]), 0
        t = {}
        t0 = time.perf_counter()
        bitmask = g.fill(matchers)
        t["fill"] = time.perf_counter() - t0
        native_out = logits.clone()
        t0 = time.perf_counter()
        apply_mask(native_out, index, bitmask)
        t["apply_native"] = time.perf_counter() - t0
        torch_out = logits.clone()
        with mock.patch.object(kernels, "native", lambda: None):
            t0 = time.perf_counter()
            apply_mask(torch_out, index, bitmask)
            t["apply_torch"] = time.perf_counter() - t0
        same = same and torch.equal(native_out, torch_out)
        t0 = time.perf_counter()
        sample_rows(logits, params, generators)
        t["sampler"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        sample_rows(logits, params, generators, history, eos, (index, bitmask))
        t["sampler_masked"] = time.perf_counter() - t0
        picked = [answers[i][at[i]] for i in range(rows)]
        t0 = time.perf_counter()
        refused = [g.advance(m, tok) for m, tok in zip(matchers, picked)]
        t["advance"] = time.perf_counter() - t0
        if any(refused):
            raise NanoserveError(f"a matcher refused the engine's own token: {next(r for r in refused if r)}")
        at = [a + 1 for a in at]
        if step >= 2:
            for k, v in t.items():
                times[k].append(v)
    return times, same


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def bench_grammar(
    engine, rows: int = 16, tokens: int = 64, repeats: int = 3, mask_steps: int = 128, say=print
) -> dict:
    """The per-step cost of grammar rows at `rows` rows (issue 32), on `engine` (max_batch >= rows).

    Mask time: `rows` matchers of eight JSON schemas advanced along what the engine generated
    under them (`_mask_replay`): fill, apply (native and torch), advance, against the sampler's
    own time for the same greedy rows without masks, and the engine's whole decode step.

    Throughput: `rows` requests decoding together, run A with none constrained, run B with the
    first half constrained, run C with all of them (the engine's step cost a grammar row). The
    three runs are three engines on the one model (and one `Grammars`), stepped in lockstep
    (`_grammar_runs`), `repeats` times after a warm-up round (which also puts the prompts in each
    engine's prefix cache, so every timed run prefills alike): on a shared machine a busy stretch
    then falls on A, B and C alike, where runs one after another could each land on a different
    load. Fairness: A, B and C are the same prompts, greedy, every row `tokens` tokens with
    ignore_eos, so the three compute the same batch shape at every step and the model's work is
    the same; what differs is the grammar work alone (the fill, the logits' copy and mask, the
    advance). A grammar could still end early (its end token taken: with ignore_eos the row then
    runs on an end-only mask, cheap to fill, which would flatter B), so every schema asks for at
    least `tokens` items, which no answer of `tokens` tokens completes; the rows where it
    happened nonetheless are counted and printed. A run's time is the sum of its own steps, its
    tokens/s over all of them (the prefill of the prompts' uncached tails and decode) and over its
    pure decode steps; the ratio B/A is of the tokens/s over every repeat, and beside it the
    median of the paired decode steps' ratios (A's time for step i over B's for the same step, run
    next to each other: B's rate over A's). The unconstrained rows of B must produce exactly
    their tokens of A (greedy; AssertionError otherwise): a grammar on one row may not move
    another's logits.

    Returns {"figures": CSV rows, "summary": the headline numbers, "equal": bool}."""
    import statistics

    from nanoserve.engine import Engine
    from nanoserve.grammar import Guided
    from nanoserve.kernels import native

    if rows < 2:
        raise NanoserveError("grammar needs 2 rows at least (half of them constrained)")
    if engine.scheduler.max_batch < rows:
        raise NanoserveError(f"the engine runs {engine.scheduler.max_batch} rows; {rows} were asked for")
    load_before = _loadavg()
    ext = native()
    has_native = ext is not None and hasattr(ext, "apply_token_bitmask")
    schemas = _grammar_schemas(tokens)
    prompts, constrain = [], []
    for i in range(rows):
        _, what, schema = schemas[i % len(schemas)]
        topic = GRAMMAR_TOPICS[(i // len(schemas)) % len(GRAMMAR_TOPICS)]
        # the request names what it wants, not the schema: a short prompt, so that a run is mostly
        # decode, where a grammar costs (the prompts are the same in every run)
        text = f"Write {what} {topic} as JSON, and nothing else."
        prompts.append([{"role": "user", "content": text}])
        constrain.append(Guided.json_schema(schema))
    for g in constrain:
        engine.grammars.compile(g)  # compiled once, before anything is timed (the server does it off-thread)
    half = rows // 2
    modes = {"A": [None] * rows, "B": constrain[:half] + [None] * (rows - half), "C": list(constrain)}
    counts = {"A": 0, "B": half, "C": rows}
    engines = {"A": engine}
    for m in ("B", "C"):  # the same model and config; the compiled grammars shared
        engines[m] = Engine(engine.model, engine.tokenizer, engine.config)
        engines[m].grammars = engine.grammars
    say(
        f"model {engine.model_name}, {rows} rows, {tokens} tokens a row, {torch.get_num_threads()} threads, "
        f"{engine.paths_line().removeprefix('paths: ')}; apply_mask native kernel "
        f"{'yes' if has_native else 'no (both apply rows are the torch fallback)'}; "
        f"load average {load_before}"
    )
    _grammar_runs(engines, prompts, modes, min(tokens, 8))  # warm-up: kernels, prefix caches
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(repeats):
        got = _grammar_runs(engines, prompts, modes, tokens)
        for m, run in got.items():
            runs[m].append(run)
            say(
                f"  round {r + 1} {m} ({counts[m]:>2}/{rows} constrained): {run['tok_s']:7.1f} tok/s "
                f"({run['tokens']} tokens in {run['seconds']:.2f} s), "
                f"decode steps {run['decode_tok_s']:7.1f} tok/s"
            )
    # a grammar must not move the other rows: B's unconstrained rows against A's, every round
    reference = runs["A"][0]["token_ids"]
    equal = all(run["token_ids"][half:] == reference[half:] for run in runs["B"]) and all(
        run["token_ids"] == reference for run in runs["A"]
    )
    # the mask's parts, replayed along what run C generated (every row under its grammar)
    times, same = _mask_replay(engine, constrain, runs["C"][0]["token_ids"], mask_steps)
    load_after = _loadavg()

    figures: list[dict] = [
        {"section": "env", "figure": "cpu", "note": cpu_line()},
        {"section": "env", "figure": "model", "note": engine.model_name},
        {"section": "env", "figure": "paths", "note": engine.paths_line()},
        {"section": "env", "figure": "load_average_before", "note": load_before},
    ]
    labels = {
        "fill": f"fill, {rows} rows (llguidance)",
        "apply_native": f"apply_mask, {rows} rows, native" + ("" if has_native else " (absent: torch)"),
        "apply_torch": f"apply_mask, {rows} rows, torch fallback",
        "advance": f"advance, {rows} matchers",
        "mask": "mask = fill + apply native + advance",
        "sampler": f"sampler, {rows} greedy rows, no masks",
        "sampler_masked": f"sampler, {rows} greedy rows, {rows} masks",
    }
    times["mask"] = [f + a + v for f, a, v in zip(times["fill"], times["apply_native"], times["advance"])]
    stats = {k: _stats_us(times[k], rows) for k in labels}
    steps = {m: [s for run in runs[m] for s in run["decode_steps"]] for m in modes}
    for m in modes:
        labels[f"step_{m}"] = f"decode step, {counts[m]}/{rows} grammar rows (engine)"
        stats[f"step_{m}"] = _stats_us(steps[m], rows)
    say(f"per step at {rows} rows, µs: median / p90 (a row: median / p90)")
    for k, label in labels.items():
        s = stats[k]
        say(
            f"  {label:<44} {s['median_us']:>9.1f} / {s['p90_us']:>9.1f}   "
            f"({s['per_row_median_us']:.1f} / {s['per_row_p90_us']:.1f} a row)"
        )
        figures.append({"section": "step", "figure": k, "rows": rows} | s | {"note": label})
    med = {k: s["median_us"] for k, s in stats.items()}
    # the engine's own cost of a grammar row: paired decode steps (step i of each run, run in turn)
    row_cost = {
        m: statistics.median((b - a) * 1e6 / counts[m] for a, b in zip(steps["A"], steps[m]))
        for m in ("B", "C")
    }
    # B's rate over A's, step by step: A's decode step time over B's at the same step
    paired = statistics.median(a / b for a, b in zip(steps["A"], steps["B"]))
    say(
        f"  mask / sampler {med['mask'] / med['sampler']:.2f}x, mask / decode step "
        f"{med['mask'] / med['step_A']:.3f}x; the engine's decode step, a grammar row (paired steps' "
        f"median): {row_cost['B']:.1f} µs with {half} grammar rows, {row_cost['C']:.1f} µs with {rows}; "
        f"apply native and torch wrote the same logits: {'yes' if same else 'NO'}"
    )
    total = {m: sum(r["tokens"] for r in runs[m]) / sum(r["seconds"] for r in runs[m]) for m in modes}
    decode = {m: rows * len(steps[m]) / sum(steps[m]) for m in modes}
    completed = {m: max(run["completed_early"] for run in runs[m]) for m in modes}
    for m in modes:
        for r, run in enumerate(runs[m]):
            figures.append(
                {
                    "section": "throughput",
                    "figure": f"run_{m}",
                    "rows": rows,
                    "constrained": counts[m],
                    "repeat": r + 1,
                    "tokens": run["tokens"],
                    "seconds": round(run["seconds"], 3),
                    "tok_s": round(run["tok_s"], 1),
                    "decode_tok_s": round(run["decode_tok_s"], 1),
                    "completed_early": run["completed_early"],
                }
            )
    ratio, ratio_decode = total["B"] / total["A"], decode["B"] / decode["A"]
    say(
        f"throughput over {repeats} rounds: A none {total['A']:.1f} tok/s, B {half}/{rows} constrained "
        f"{total['B']:.1f} tok/s, ratio B/A {ratio:.3f} (decode steps {decode['A']:.1f} against "
        f"{decode['B']:.1f}, {ratio_decode:.3f}; paired steps' median {paired:.3f}); "
        f"C all constrained {total['C']:.1f} tok/s ({total['C'] / total['A']:.3f}x A)"
    )
    say(
        f"  unconstrained rows' tokens in B equal A's: {'yes' if equal else 'NO'} ({rows - half} rows, "
        f"{repeats} rounds); grammars complete before the last token: {completed['B']} of {half} in B, "
        f"{completed['C']} of {rows} in C; load average {load_before} before, {load_after} after"
    )
    summary = {
        "fill_us": med["fill"],
        "fill_us_row": stats["fill"]["per_row_median_us"],
        "apply_native_us": med["apply_native"],
        "apply_torch_us": med["apply_torch"],
        "advance_us": med["advance"],
        "mask_us": med["mask"],
        "sampler_us": med["sampler"],
        "sampler_masked_us": med["sampler_masked"],
        "step_us": med["step_A"],
        "step_half_us": med["step_B"],
        "step_all_us": med["step_C"],
        "row_cost_half_us": round(row_cost["B"], 1),
        "row_cost_all_us": round(row_cost["C"], 1),
        "tok_s_A": round(total["A"], 1),
        "tok_s_B": round(total["B"], 1),
        "tok_s_C": round(total["C"], 1),
        "ratio_B_A": round(ratio, 3),
        "ratio_B_A_decode": round(ratio_decode, 3),
        "ratio_B_A_paired": round(paired, 3),
        "completed_early_B": completed["B"],
        "unconstrained_equal": equal,
        "apply_same": same,
    }
    for k in ("ratio_B_A", "ratio_B_A_decode", "ratio_B_A_paired", "row_cost_half_us", "row_cost_all_us"):
        figures.append({"section": "summary", "figure": k, "value": summary[k]})
    figures.append({"section": "env", "figure": "load_average_after", "note": load_after})
    assert equal, "a grammar on some rows changed the tokens of the unconstrained rows"
    assert same, "apply_mask's native kernel and its torch fallback wrote different logits"
    return {"figures": figures, "summary": summary, "equal": equal}


def cmd_grammar(args) -> None:
    """Mask time a step and throughput with half the rows constrained, at --rows rows."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import build_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    config = EngineConfig(
        model=args.model,
        weights=None if args.weights == "dtype" else args.weights,
        quant_activations=args.quant_activations,
        max_batch=args.rows,
        max_model_len=args.max_model_len,
    )
    engine = build_engine(config)
    result = bench_grammar(engine, args.rows, args.tokens, args.repeats, args.mask_steps)
    if args.csv:
        write_csv(result["figures"], args.csv, cpu=True)
    s = result["summary"]
    print(
        f"RESULT grammar rows={args.rows} fill_us={s['fill_us']} ({s['fill_us_row']}/row) "
        f"apply_native_us={s['apply_native_us']} apply_torch_us={s['apply_torch_us']} "
        f"advance_us={s['advance_us']} sampler_us={s['sampler_us']} step_us={s['step_us']} "
        f"tok_s A={s['tok_s_A']} B={s['tok_s_B']} ratio={s['ratio_B_A']}x paired={s['ratio_B_A_paired']}x "
        f"unconstrained_equal={s['unconstrained_equal']}"
    )


SPEC_WORKLOADS = ("edit", "summary", "free")


def _spec_workloads(clients: int, requests: int, copy_tokens: int, free_tokens: int) -> dict:
    """The three workloads of `bench speculative` for one client count: two that copy their
    prompt (loadgen.copy_workload) and a free one (bench serve's chat questions)."""
    from nanoserve.loadgen import chat_workload, copy_workload

    n = max(requests, clients)
    return {
        "edit": copy_workload("edit", n, copy_tokens),
        "summary": copy_workload("summary", n, copy_tokens, lines=100),
        "free": chat_workload(n, free_tokens),
    }


def verify_costs(model: str, rows=(1, 16), drafts=(0, 1, 3, 7), repeats: int = 15) -> list[dict]:
    """A step's time (median of `repeats`) with `rows` decoding rows each carrying `drafts` draft
    tokens, through the engine's fused step (plan_verify): what a draft token costs."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine import build_engine
    from nanoserve.plan import plan_decode, plan_verify
    from nanoserve.sampling import SamplingParams

    eng = build_engine(EngineConfig(model=model, weights="gguf", quant_activations="int8",
                                    max_batch=max(rows), max_model_len=2048))  # fmt: skip
    for i in range(max(rows)):
        eng.add_request(list(range(100 + i, 700 + i)), SamplingParams(max_tokens=400, ignore_eos=True))
    while any(s.needs_prefill for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    seqs, out = list(eng.scheduler.running), []
    for b in rows:
        for k in drafts:
            for s in seqs[:b]:
                s.draft = [5] * k
                eng.allocator.append_slots(s.block_table, len(s.token_ids) + k)
            plan = (plan_verify if k else plan_decode)(seqs[:b], eng.config.block_size)
            run = lambda plan=plan: eng.runner.execute(plan)  # noqa: E731
            run()
            times = sorted(_timed(run) for _ in range(repeats))
            out.append({"rows": b, "draft_tokens": k, "step_ms": round(1000 * times[repeats // 2], 2)})
            for s in seqs[:b]:
                s.draft = []
    return out


def cmd_speculative(args) -> None:
    """Speculative decoding's n-gram drafts against none, and against llama.cpp's ngram-simple,
    on copy-heavy and free workloads, at 1 and 16 clients. Each server runs every workload; the
    row's decode tok/s is a stream's (1 / TPOT p50: what speculation changes; prefill it does
    not), out tok/s the run's output over its wall time, prefill included."""
    import asyncio

    from nanoserve.fetch import model_gguf
    from nanoserve.loadgen import run_load, summarize

    print(cpu_line())
    if args.costs:
        costs = verify_costs(args.model)
        for c in costs:
            base = next(x for x in costs if x["rows"] == c["rows"] and x["draft_tokens"] == 0)
            print(f"{c['rows']:>2} rows, {c['draft_tokens']} draft tokens each: {c['step_ms']:6.1f} ms "
                  f"({c['step_ms'] / base['step_ms']:.2f}x the step without)")  # fmt: skip
        if args.csv:
            path = Path(args.csv).with_name(Path(args.csv).stem + "-costs.csv")
            write_csv(costs, path, cpu=True)
    model_args = ["--model", args.model, "--max-batch", str(max(args.clients))]
    servers = [
        ("nanoserve", model_args, None),
        (f"nanoserve --speculative ngram (K {args.k})", model_args + ["--speculative", "ngram",
         "--num-speculative-tokens", str(args.k)], None),
    ]  # fmt: skip
    if args.llama_server:
        gguf = str(model_gguf(args.model))
        servers += [
            ("llama-server", [], gguf),
            ("llama-server --spec-type ngram-simple", ["--spec-type", "ngram-simple"], gguf),
        ]
    loads = {
        c: _spec_workloads(c, args.requests if c == 1 else c, args.copy_tokens, args.free_tokens)
        for c in args.clients
    }
    print(
        f"workloads: edit ({len(loads[args.clients[0]]['edit'])}+ requests: 200 lines of code "
        f"written out again with one rename, up to {args.copy_tokens} tokens), summary (a journal "
        f"entry's first 50 lines summarized quoting it, up to {args.copy_tokens}), free (chat "
        f"questions, {args.free_tokens} tokens, ignore_eos); greedy; clients {args.clients}"
    )
    rows = []
    for name, flags, gguf in servers:
        if gguf is None:
            srv = ServerProcess(flags, _free_port(), args.threads)
        else:
            ctx = args.ctx * max(args.clients)
            slots, threads = max(args.clients), args.threads or 2
            srv = PeerProcess(args.llama_server, gguf, _free_port(), slots, ctx, threads, flags)
        with srv:
            import httpx

            for clients in args.clients:
                for kind in SPEC_WORKLOADS:
                    reqs = loads[clients][kind]
                    asyncio.run(run_load(srv.url, reqs[:1], 1))  # settle: connections, first allocations
                    spec = lambda url=srv.url: httpx.get(url + "/health").json().get("speculative")  # noqa: E731
                    before = spec() if gguf is None else None
                    report = asyncio.run(run_load(srv.url, reqs, clients))
                    row = {"server": name, "workload": kind} | summarize(report)
                    row["decode_tok_s"] = round(1000 / row["tpot_p50_ms"], 1) if row["tpot_p50_ms"] else None
                    after = spec() if gguf is None else None
                    if before and after:
                        kept, tried = (after[k] - before[k] for k in ("accepted_tokens", "draft_tokens"))
                        row["acceptance"] = round(kept / tried, 3) if tried else 0.0
                        row["verifications"] = after["verifications"] - before["verifications"]
                    rows.append(row)
                    print(
                        f"{name:>40} | {kind:>7} | {clients:>2} clients | decode {row['decode_tok_s']} tok/s "
                        f"| out {row['output_tok_s']} tok/s | tokens {row['output_tokens']} | TTFT p50 "
                        f"{row['ttft_p50_ms']:.0f} ms | acceptance {row.get('acceptance', '-')} | "
                        f"incomplete {row['incomplete']}",
                        flush=True,
                    )
    print()
    for clients in args.clients:
        for kind in SPEC_WORKLOADS:
            got = {r["server"]: r for r in rows if r["workload"] == kind and r["concurrency"] == clients}
            spec, off = got[servers[1][0]], got[servers[0][0]]
            ratio = lambda a, b, k: f"{a[k] / b[k]:.2f}x"  # noqa: E731
            line = (
                f"{kind:>7}, {clients:>2} clients: ngram / off decode {ratio(spec, off, 'decode_tok_s')}, "
                f"out {ratio(spec, off, 'output_tok_s')}"
            )
            peer = got.get("llama-server --spec-type ngram-simple")
            if peer:
                line += (
                    f"; against llama-server ngram-simple decode {ratio(spec, peer, 'decode_tok_s')}, "
                    f"out {ratio(spec, peer, 'output_tok_s')}"
                )
            print(line)
    if args.csv:
        write_csv(rows, args.csv, cpu=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("decode", help="batch-1 decode against transformers' generate")
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "both", "none"], default="both")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--csv", default=None, help="also write the rows to this CSV")
    p.add_argument(
        "--quant",
        nargs="*",
        default=["q4_1/fp32", "q4_1/int8"],
        help="quantized rows, WEIGHTS/ACTIVATIONS, from the GGUF's own blocks (default: q4_1/fp32 q4_1/int8)",
    )
    p.add_argument(
        "--gguf", default=None, help="the GGUF for the quantized rows (default: the default model's)"
    )
    p.add_argument(
        "--llama-server", default=None, help="a llama-server binary: llama.cpp's rate on the same GGUF"
    )
    p.add_argument(
        "--llama-bench", default=None, help="a llama-bench binary: llama.cpp's rate on the same GGUF"
    )
    p = sub.add_parser("throughput", help="continuous batching against transformers' static batches")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="float32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--max-batch", type=int, default=64, help="nanoserve's rows")
    p.add_argument("--batched-tokens", type=int, default=512, help="nanoserve's prefill tokens per step")
    p.add_argument("--hf-batch", type=int, default=16, help="transformers' static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--csv", default=None)
    p = sub.add_parser("serve", help="the HTTP server under concurrent streaming load; warm against lazy")
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--long", type=int, default=512, help="tokens of the warm-vs-lazy long generation")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--weights",
        default="dtype",
        help="the servers' --weights (default dtype: the converted model, where capture runs)",
    )
    p.add_argument("--csv", default=None, help="write the load rows here and the warm rows next to it")
    # with --url, --nanoserve or --llama-server: the token workload against those servers instead
    p.add_argument("--url", action="append", help="[NAME=]URL of a server already running (repeatable)")
    p.add_argument(
        "--nanoserve", action="append", help="start `nanoserve serve` with these options (repeatable)"
    )
    p.add_argument("--llama-server", default=None, help="a llama-server binary to start on the GGUF")
    p.add_argument("--gguf", default=None, help="llama-server's GGUF (default: the one fetch-model got)")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server's -c (context over all slots)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn from [17, vocab)")
    p.add_argument("--seed", type=int, default=None, help="the workload's seed (default: the clock)")
    p = sub.add_parser("admission", help="a tight KV pool: admission with the watermark against without")
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-budget", default="64MiB", help="a pool far smaller than the workload wants")
    p.add_argument("--watermark", type=float, default=0.05)
    p.add_argument("--schedule", choices=["budget", "prefill-first"], default="prefill-first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--csv", default=None)
    p = sub.add_parser("tp", help="tensor parallelism: memory a rank holds against one process")
    p.add_argument("--model", default=None)
    p.add_argument("--ranks", type=int, nargs="*", default=None, help="rank counts (default: all it allows)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--csv", default=None)
    p = sub.add_parser("grammar", help="structured output: mask time a step, throughput half constrained")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="a model name or directory")
    p.add_argument("--weights", default="gguf", help="gguf, q4_1, q8_0, or dtype (the directory's fp32)")
    p.add_argument("--quant-activations", choices=["int8", "fp32"], default="int8")
    p.add_argument("--rows", type=int, default=16, help="rows decoding together (half constrained in B)")
    p.add_argument("--tokens", type=int, default=64, help="tokens each row generates (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3, help="times runs A, B and C alternate")
    p.add_argument("--mask-steps", type=int, default=128, help="steps of the mask replay timed")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--csv", default=None, help="also write every figure to this CSV")
    p = sub.add_parser("speculative", help="n-gram speculative decoding against none and llama.cpp's")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="a model name or directory")
    p.add_argument("--k", type=int, default=3, help="--num-speculative-tokens")
    p.add_argument("--costs", action="store_true", help="first, a step's time by rows and draft tokens")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=2, help="requests of each workload at 1 client")
    p.add_argument("--copy-tokens", type=int, default=256, help="max_tokens of the copy-heavy requests")
    p.add_argument("--free-tokens", type=int, default=128, help="max_tokens of the free requests")
    p.add_argument("--llama-server", default=None, help="a llama-server binary: plain and ngram-simple")
    p.add_argument("--ctx", type=int, default=4096, help="llama-server's context a slot")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--csv", default=None)
    args = parser.parse_args(argv)

    commands = {
        "decode": cmd_decode,
        "throughput": cmd_throughput,
        "serve": lambda a: cmd_peers(a) if (a.url or a.nanoserve or a.llama_server) else cmd_serve(a),
        "admission": cmd_admission,
        "tp": cmd_tp,
        "grammar": cmd_grammar,
        "speculative": cmd_speculative,
    }
    try:
        commands[args.bench](args)
    except NanoserveError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
