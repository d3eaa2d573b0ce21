"""Day 65's tables: Gemma 3's sliding-window layers in the paged cache, which positions they
read, which blocks they hold, and the bytes that saves.

Three CSVs, written next to this file:

* `day-65-blocks.csv`: for one row of Gemma 3 270M's geometry (window 512, blocks of 16) and a
  list of steps (a prompt chunk or a decode token, positions [start, end)), the window worked out
  by hand: the first position the step's queries read, max(0, start - window + 1), its block, the
  last block the step writes, how many blocks a sliding layer holds for the row and how many it
  has given back; and whether `WindowBlocks.first_needed` and `WindowBlocks.prepare` agree.
* `day-65-tokens.csv`: a tiny random Gemma 3 (`tiny_gemma3`: 6 layers, 0-4 sliding over 8
  positions, 5 global; built with transformers' own classes) through the paged engine, four
  prompts of 9-40 tokens decoding 24 greedy tokens each past the window, with blocks of 4: the
  engine as built (sliding layers on their own blocks, or one pool for all) and three planted
  mistakes (a window of 9 or 7 in the cache, the oldest block of a window given back one block
  early). Per variant, how many of the 4 rows equal the model's own greedy tokens, and in how
  many steps `WindowBlocks.check_rows` found a row without a sliding block its queries read (a
  block given back keeps its K/V until it is handed out again, so tokens alone may not show it).
* `day-65-memory.csv`: the K/V bytes `Engine.kv_bytes_held()` reports for one row at a few
  contexts up to 4,096, with the sliding layers on their own blocks (`window_blocks=True`) and
  without, for a model with Gemma 3 270M's cache geometry (its `config.json`: 18 layers, every
  sixth global, 1 K/V head of 256, window 512) and toy matrices (hidden 64, vocabulary 256, one
  query head, random weights): the K/V a token costs depends only on the cache geometry.

The notebook calls `block_rows`, `tiny_gemma3`, `token_rows`, `toy_270m` and `memory_rows`.

    python days/day65/windowbench.py                      # writes the three CSVs here
    python days/day65/windowbench.py --contexts 512 8192  # other contexts (the pool grows to fit)
    python days/day65/windowbench.py --out /tmp/d65       # elsewhere
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockTable, WindowBlocks
from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.fetch import fetch_named_model
from nanoserve.generate import greedy_tokens
from nanoserve.models import LlamaConfig, load_model
from nanoserve.models.gemma import Gemma3
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
SEED = 65
GEMMA = "gemma-3-270m"

# --- which blocks a sliding layer holds, by hand ---

WINDOW, BLOCK = 512, 16  # Gemma 3 270M's window; the engine's default block size
# (start, end) of one row's steps: a 1,500-token prompt in chunks of 512, then decode tokens
STEPS = [(0, 512), (512, 1024), (1024, 1500), (1500, 1501), (1501, 1502), (2046, 2047)]
STEPS += [(2047, 2048), (2048, 2049), (4095, 4096)]


def window_by_hand(start: int, end: int, window: int = WINDOW, block: int = BLOCK) -> dict:
    """What a sliding layer needs for a step over positions [start, end): query p reads keys j
    with p - window < j <= p, so the step reads from position max(0, start - window + 1) (its
    first query's window) and writes up to end - 1."""
    first_pos = max(0, start - window + 1)
    first, last = first_pos // block, (end - 1) // block
    return {
        "start": start,
        "end": end,
        "first_position_read": first_pos,
        "first_block": first,
        "last_block": last,
        "blocks_held": last - first + 1,
        "blocks_given_back": first,
    }


def block_rows(steps=STEPS, window: int = WINDOW, block: int = BLOCK) -> list[dict]:
    """One row of day-65-blocks.csv per step, run through `WindowBlocks` as the engine runs it:
    `prepare` for each step in order, then which block indices the row holds."""
    table = BlockTable(block, list(range(1000, 1000 + -(-steps[-1][1] // block))))  # full blocks
    seq = SimpleNamespace(block_table=table, num_computed=0)
    blocks = WindowBlocks(num_blocks=512, block_size=block, window=window, num_full_blocks=2000)
    rows = []
    for start, end in steps:
        row = window_by_hand(start, end, window, block)
        seq.num_computed = start  # as in the engine: the step computes from the first uncomputed position
        blocks.prepare([(seq, start, end)])
        held = sorted(blocks.held[id(seq)][1])
        row["first_needed_agrees"] = blocks.first_needed(start) == row["first_block"]
        row["prepare_agrees"] = held == list(range(row["first_block"], row["last_block"] + 1))
        rows.append(row)
    blocks.leave(seq)
    assert blocks.num_used == 0
    return rows


# --- a tiny Gemma 3, held to transformers, and planted mistakes through the paged engine ---

TINY_GEMMA3 = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,  # 0-4 slide over the latest 8 positions (rotary base 100), 5 reads all
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=20,  # not head_dim, so a scale taken from head_dim would show
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    attn_implementation="eager",
)
TOL = 1e-4  # our logits against transformers' on the tiny model: fp32 sums in another order
IDS = list(range(3, 43))  # 40 positions: five windows
PROMPTS = [list(range(3, 3 + n)) for n in (9, 23, 40, 31)]
NEW_TOKENS = 24
ENGINE = dict(max_batch=4, max_num_batched_tokens=16, block_size=4)


def tiny_gemma3(path: Path, seed: int = SEED):
    """A random-weight Gemma 3 checkpoint written to `path` (config.json, model.safetensors, an
    empty tokenizer.json: the tiny model takes ids); returns transformers' model of it. Norm
    weights are drawn from U(0.5, 1.5) instead of starting at 0 (a gain of 1 + w), so a norm
    read wrongly cannot hide."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(**TINY_GEMMA3)
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, path / "model.safetensors")
    (path / "tokenizer.json").write_text("{}")
    return hf


def engine_tokens(model, prompts=PROMPTS, n: int = NEW_TOKENS, **config):
    """Greedy tokens of each prompt, all rows through one paged engine; (tokens, engine)."""
    engine = Engine(model, None, EngineConfig(**{**ENGINE, **config}))
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs], engine


@contextmanager
def planted(mistake: str | None):
    """The engine as built (None), or with one mistake planted for the duration:
    "window 9" / "window 7": the cache's sliding layers read that many positions, not 8;
    "freed early": a row gives back the oldest block its window still reads (never the blocks
    the step writes)."""
    if mistake is None:
        yield
        return
    if mistake.startswith("window "):
        wrong, init = int(mistake.split()[1]), Engine.__init__

        def init_planted(self, *args, **kw):
            init(self, *args, **kw)
            self.cache.windows = [wrong if w else None for w in self.cache.windows]

        with mock.patch.object(Engine, "__init__", init_planted):
            yield
        return
    if mistake == "freed early":
        right = WindowBlocks.first_needed

        def first_needed(self, start):
            return min(right(self, start) + 1, start // self.block_size)

        with mock.patch.object(WindowBlocks, "first_needed", first_needed):
            yield
        return
    raise ValueError(f"no planted mistake called {mistake!r}")


# variant -> (window_blocks, planted mistake)
VARIANTS = {
    "sliding blocks of their own": (True, None),
    "one pool for all layers": (False, None),
    "window 9 in the cache": (False, "window 9"),
    "window 7 in the cache": (False, "window 7"),
    "oldest block given back early": (True, "freed early"),
}


@contextmanager
def rows_checked():
    """While on, every `WindowBlocks.prepare` is followed by `WindowBlocks.check_rows`, and the
    run goes on: yields (steps checked, the messages of the steps that failed)."""
    steps, failed = [0], []
    prepare = WindowBlocks.prepare

    def checked(self, chunks):
        prepare(self, chunks)
        steps[0] += 1
        try:
            self.check_rows(chunks)
        except AssertionError as e:
            failed.append(str(e))

    with mock.patch.object(WindowBlocks, "prepare", checked):
        yield steps, failed


def token_rows(model, variants=VARIANTS, messages: dict | None = None) -> list[dict]:
    """One row of day-65-tokens.csv per variant: rows whose tokens equal the model's own greedy
    tokens (`greedy_tokens`, a contiguous cache), the first token index where any row parts, and
    how many steps `WindowBlocks.check_rows` failed ("-" with one pool: no sliding blocks to
    check). `messages`, if given, gets each variant's first failure."""
    want = [greedy_tokens(model, p, NEW_TOKENS) for p in PROMPTS]
    rows = []
    for name, (window_blocks, mistake) in variants.items():
        with planted(mistake), rows_checked() as (steps, failed):
            got, engine = engine_tokens(model, window_blocks=window_blocks)
        parts = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
        if messages is not None and failed:
            messages[name] = failed[0]
        rows.append(
            {
                "variant": name,
                "window_blocks": window_blocks,
                "cache_windows": "/".join(str(w) for w in sorted({w for w in engine.cache.windows if w})),
                "rows": len(PROMPTS),
                "rows_equal": sum(p is None for p in parts),
                "first_parted_at": min((p for p in parts if p is not None), default="-"),
                "check_rows_failed": f"{len(failed)} of {steps[0]} steps" if window_blocks else "-",
            }
        )
    return rows


# --- memory: Gemma 3 270M's cache geometry, toy matrices ---

TOY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=1)
CONTEXTS = (256, 512, 1000, 2048, 4096)


def gemma_270m_config() -> LlamaConfig:
    return LlamaConfig.from_dir(fetch_named_model(GEMMA))


def max_len(contexts) -> int:
    """The context the memory runs' model and engines are built for: the longest, and room to
    generate."""
    return max(contexts) + 64


def toy_270m(contexts=CONTEXTS, seed: int = SEED) -> Gemma3:
    """Gemma 3 270M's config.json with TOY's sizes put in: the same layers, K/V heads, head dim,
    window and layer types (so the same K/V bytes a token), small matrices of random weights."""
    length = max_len(contexts)
    d = json.loads((fetch_named_model(GEMMA) / "config.json").read_text())
    cfg = LlamaConfig.from_dict({**d, **TOY, "max_position_embeddings": length})
    torch.manual_seed(seed)
    model = Gemma3(cfg, max_positions=length)
    for p in model.parameters():
        p.normal_(0, 0.05)
    return model.eval()


def memory_config(model, contexts=CONTEXTS, window_blocks: bool = True) -> EngineConfig:
    """One budget for both ways: every layer holding every position of the longest context (and
    a generated token or two) in one pool."""
    per_token, length = model.cfg.kv_bytes_per_token(model.dtype), max_len(contexts)
    return EngineConfig(
        max_batch=1,  # one request at a time: the sliding pool sized for one row's window and a chunk
        max_num_batched_tokens=512,
        block_size=BLOCK,
        max_model_len=length,
        kv_budget=per_token * (length + 40),
        enable_prefix_caching=False,  # each context computed from scratch, the same way both ways
        window_blocks=window_blocks,
    )


def held_at(engine: Engine, context: int) -> dict:
    """Run one request of context - 1 prompt tokens until its K/V covers `context` positions (the
    prompt and one decode step, whose query reads the latest window): what the row holds then.
    The request is then run to its end, so the engine is empty again."""
    prompt = [3 + i % 250 for i in range(context - 1)]
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    seen = None
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        if seen is None and running and running[0].num_computed == context:
            wb = engine.window_blocks
            seen = {
                "full_blocks": engine.allocator.num_used,
                "sliding_blocks": wb.num_used if wb is not None else 0,
                "bytes": engine.kv_bytes_held(),
                "sliding_held": sorted(wb.held[id(running[0])][1]) if wb is not None else [],  # block indices
            }
    assert seen is not None and engine.allocator.num_used == 0
    return seen


def memory_rows(model, contexts=CONTEXTS):
    """(one row of day-65-memory.csv per context, the two engines by window_blocks, and the block
    indices the sliding layers held for the row at each context)."""
    engines = {wb: Engine(model, None, memory_config(model, contexts, wb)) for wb in (False, True)}
    rows, sliding_held = [], {}
    for c in contexts:
        without, with_ = held_at(engines[False], c), held_at(engines[True], c)
        sliding_held[c] = with_["sliding_held"]
        rows.append(
            {
                "context": c,
                "blocks_without": without["full_blocks"],
                "bytes_without": without["bytes"],
                "full_blocks_with": with_["full_blocks"],
                "sliding_blocks_with": with_["sliding_blocks"],
                "bytes_with": with_["bytes"],
                "ratio": f"{without['bytes'] / with_['bytes']:.2f}",
            }
        )
    return rows, engines, sliding_held


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    ap.add_argument("--out", default=str(HERE), help="folder for the CSVs")
    args = ap.parse_args(argv)
    print(cpu_line())
    t0 = time.perf_counter()
    tables = {"day-65-blocks.csv": block_rows()}
    with tempfile.TemporaryDirectory(prefix="day65-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' import warns about tqdm's notebook widgets
        tiny_gemma3(Path(tmp), args.seed)
        tables["day-65-tokens.csv"] = token_rows(load_model(tmp))
    model = toy_270m(args.contexts, args.seed)
    tables["day-65-memory.csv"] = memory_rows(model, args.contexts)[0]
    for name, rows in tables.items():
        write_csv(rows, Path(args.out) / name)
        print(name)
        for row in rows:
            print("  ", row)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
