"""The course's own helpers: what the notebooks, day scripts and tests share, outside the engine.

Nothing in `nanoserve` imports this package; it is the reader's toolbox, not the runtime's.

* `engine_config(day, **overrides)`, `engine_as_of(day, model, tokenizer, **overrides)`: the
  engine as it stood on a day of the course, its named variants pinned from one table
  (`nanocourse.engines.HISTORY`); `describe(day)` says which variant each day chose and why.
* `diagram_path(name)`: where a notebook saves a figure. Under `make notebooks`
  (NANOSERVE_WRITE_DIAGRAMS=1) that is the repo's `diagrams/`; otherwise, and so under
  `pytest --nbval`, a temporary folder, so running a notebook never changes a tracked file.
* `write_csv(rows, path)`, `read_csv(path)`, `show(rows, columns)`, `as_text(rows)`: a day
  script's table written the same way every time, read back, printed as plain rows.
* `check_close(got, want, what, bound)`: a relative-error check that prints its bound.
* `top2_gap(model, tokens)`, `same_or_near_tie(model, prompt, ref, got)`: whether two ways'
  differing tokens part at a near-tie of rounding; `recording_cache()`: uncached attention
  that keeps each layer's K.
* `best_of(fn, repeats)`: the fastest of a few timed calls, in seconds (book/timing.md says why
  the minimum).
* `tiny_config(...)`, `tiny_llama(seed, std, ...)`: the random-weight Llama the day scripts run
  when the default model would be slower than the idea needs (2 layers, hidden 64, vocab 256).
* `cpu_profile()`: `torch.profiler` over the CPU without the lines it prints from C++.
* `ServerThread(app)`, `served(engine)`: uvicorn on a background thread (`nanoserve.threads`,
  which the benchmarks use too), re-exported here for the notebooks.
"""

from __future__ import annotations

import csv
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from nanocourse.engines import HISTORY, describe, engine_as_of, engine_config
from nanoserve.bench import cpu_line, write_csv
from nanoserve.threads import ServerThread, served

__all__ = [
    "HISTORY",
    "REPO",
    "ServerThread",
    "as_text",
    "best_of",
    "check_close",
    "cpu_line",
    "cpu_profile",
    "describe",
    "diagram_path",
    "engine_as_of",
    "engine_config",
    "read_csv",
    "recording_cache",
    "same_or_near_tie",
    "served",
    "show",
    "tiny_config",
    "tiny_llama",
    "top2_gap",
    "write_csv",
]

REPO = Path(__file__).resolve().parents[1]


def diagram_path(name: str) -> Path:
    if os.environ.get("NANOSERVE_WRITE_DIAGRAMS"):
        folder = REPO / "diagrams"
    else:
        folder = Path(tempfile.gettempdir()) / "nanoserve-diagrams"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def read_csv(path: str | Path) -> list[dict]:
    """A CSV's rows as dicts of strings (as `write_csv` wrote them)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def show(rows: list[dict], columns: list[str] | None = None) -> None:
    """Rows as plain lines, the columns joined by " | " (the header first)."""
    columns = columns or list(rows[0])
    print(" | ".join(columns))
    for r in rows:
        print(" | ".join(str(r[c]) for c in columns))


def as_text(rows: list[dict]) -> list[dict]:
    """Every value as the string a CSV would hold, to compare fresh rows with committed ones."""
    return [{k: str(v) for k, v in r.items()} for r in rows]


def check_close(got, want, what: str, bound: float = 1e-5) -> None:
    """max |got - want| within `bound` of max |want| (torch tensors), or AssertionError."""
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err <= bound:
        raise AssertionError(f"{what}: relative difference {err:.2g} exceeds {bound:g}")
    print(f"{what}: within {bound:g}")


def best_of(fn, repeats: int = 5) -> float:
    """Seconds of the fastest of `repeats` calls of `fn()`: the noise of a shared machine only
    ever adds time, so the minimum is the closest to what the code costs (book/timing.md)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def top2_gap(model, tokens: list[int]) -> float:
    """How far the top logit after `tokens` is above the second (one uncached forward): a
    token that differs between two ways where this is tiny is a near-tie of float rounding,
    not a bug."""
    import torch

    from nanoserve.contiguous import NoCache

    cache, pos = NoCache(), torch.arange(len(tokens))
    cache.begin(pos)
    logits = model(torch.tensor(tokens), pos, cache, logits_at=torch.tensor([len(tokens) - 1]))[0]
    top = logits.topk(2).values
    return (top[0] - top[1]).item()


def same_or_near_tie(model, prompt_ids: list[int], ref: list[int], got: list[int], tie: float = 1e-4) -> str:
    """ "equal", or where `got` leaves `ref` when the top-2 gap there is under `tie`; otherwise
    AssertionError (a real difference)."""
    if got == ref:
        return "equal"
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    gap = top2_gap(model, prompt_ids + ref[:k])
    assert gap < tie, f"tokens differ at {k} with a top-2 gap of {gap:.2e}"
    return f"near-tie at {k} (gap {gap:.1e})"


def recording_cache():
    """A `NoCache` (day 11's uncached attention) that keeps each layer's K as written:
    `cache.kept[layer]` is (N, kv_heads, head_dim). Day 11 builds the idea; later days use this."""
    from nanoserve.contiguous import NoCache

    class Recording(NoCache):
        def __init__(self):
            self.kept = {}

        def write(self, layer, k, v):
            super().write(layer, k, v)
            self.kept[layer] = k.clone()

    return Recording()


def tiny_config(max_position_embeddings: int = 512):
    """The day scripts' tiny Llama: 2 layers, hidden 64, 4 heads (2 KV, head dim 16), vocab 256."""
    from nanoserve.models import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
    )


def tiny_llama(seed: int = 0, std: float = 0.05, max_position_embeddings: int = 512):
    """`tiny_config`'s model with every weight drawn from N(0, std) after seeding torch."""
    import torch

    from nanoserve.models import Llama

    torch.manual_seed(seed)
    model = Llama(tiny_config(max_position_embeddings))
    for p in model.parameters():
        p.normal_(0, std)
    return model.eval()


@contextmanager
def _fd2_to_devnull():
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextmanager
def cpu_profile():
    """`torch.profiler.profile` over the CPU. Its start and stop each write a timestamped line
    from C++ straight to file descriptor 2 (which would land in a notebook's outputs); those
    two calls run with it pointed at /dev/null."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _fd2_to_devnull():
        prof.start()
    try:
        yield prof
    finally:
        with _fd2_to_devnull():
            prof.stop()
