"""Day 13: what a contiguous K/V cache wastes, against a paged pool of 16-token blocks.

Every number here is counted in slots (one token's K/V, all layers; 46,080 bytes for SmolLM2-135M
in fp32) and is deterministic: the requests are seeded draws, and nothing is timed.

The requests. Prompt and output lengths are drawn from two independent lognormals, a positive,
right-skewed law with a long tail (most requests are short, a few are very long), which is the
usual first model of chat traffic's lengths. The medians (256 prompt tokens, 128 output tokens)
and the spread (sigma 1.0 in log space, so the middle half of the draws spans about 4x) are
assumptions, not a fit to a trace. Prompts are cut to 1,536 tokens and outputs to the request's
`max_tokens` of 512, so every request fits a 2,048-token context. A request writes the K/V of
its prompt and of every generated token but the last (nothing runs after the last one):
prompt + output - 1 slots.

Three ways to hold a request's K/V:

* `max_len`: a contiguous reservation of the whole context, 2,048 slots, for any request
  (`ContiguousKVCache(cfg, 2048)`: the server cannot know the output's length in advance);
* `prompt+max_tokens`: a contiguous reservation of the prompt plus the request's token budget,
  as Day 11's `decode_loop` sizes it; different requests reserve different sizes;
* `paged16`: blocks of 16 slots taken as the sequence grows (`nanoserve.blocks.BlockAllocator`),
  so only the last block's tail is ever unwritten.

Two tables:

* `day-13-waste.csv`: over `--requests` draws, what each way reserves against what is written
  (internal fragmentation: reserved, never written); `day-13-lengths.csv`, the quantiles of the
  draws and of each way's waste per request.
* `day-13-sim.csv`: Poisson arrivals into one memory of `--memory` slots, each contiguous way
  placing its reservations first-fit in one address range (`Arena`) and running every admitted
  request one token a step. Sampled at every step in which a request is waiting: what is
  reserved, written, free, and free only in holes too small for a new 2,048-slot reservation
  (external fragmentation); the same running requests are mirrored in a `BlockAllocator`, which
  gives what a paged pool would hold for them.

    python days/day13/waste.py                     # -> the three CSVs next to this file
    python days/day13/waste.py --requests 100000 --sim-requests 5000 --out-waste /tmp/w.csv
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from nanocourse import write_csv
from nanoserve.blocks import BlockAllocator, BlockTable

HERE = Path(__file__).resolve().parent
CSV_WASTE = HERE / "day-13-waste.csv"
CSV_LENGTHS = HERE / "day-13-lengths.csv"
CSV_SIM = HERE / "day-13-sim.csv"

MAX_LEN = 2048  # the context a request may use, and what a `max_len` reservation takes
MAX_TOKENS = 512  # every request's token budget
MAX_PROMPT = MAX_LEN - MAX_TOKENS
BLOCK = 16
PROMPT_MEDIAN, OUTPUT_MEDIAN, SIGMA = 256, 128, 1.0
REQUESTS = 10_000  # draws for the waste table
SIM_REQUESTS = 2_000  # arrivals in the simulation
MEMORY = 16 * MAX_LEN  # simulated K/V memory in slots: 16 whole-context reservations
RATE = 0.25  # arrivals a step: more than either contiguous way can serve, so requests wait
SEED = 13
POLICIES = ("max_len", "prompt+max_tokens", "paged16")


# --- the requests -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    rid: int
    arrival: int  # the step it arrives at
    prompt: int
    output: int  # tokens generated, the last one included

    @property
    def written(self) -> int:
        """Slots whose K/V is written by the end: the prompt and every generated token but the last."""
        return self.prompt + self.output - 1


def draw_requests(n: int, seed: int = SEED, rate: float = RATE) -> list[Request]:
    """n requests with lognormal lengths and Poisson arrivals (exponential gaps, `rate` a step)."""
    rng = random.Random(seed)
    out, clock = [], 0.0
    for rid in range(n):
        prompt = min(MAX_PROMPT, max(1, round(rng.lognormvariate(math.log(PROMPT_MEDIAN), SIGMA))))
        output = min(MAX_TOKENS, max(1, round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), SIGMA))))
        out.append(Request(rid, int(clock), prompt, output))
        clock += rng.expovariate(rate)
    return out


def paged_slots(written: int, block_size: int = BLOCK) -> int:
    """Slots of the blocks that hold `written` tokens: 40 -> 48 at 16 a block."""
    return -(-written // block_size) * block_size


def held(policy: str, req: Request, written: int | None = None) -> int:
    """Slots `policy` holds for req once `written` of its slots are filled (default: all of them)."""
    if policy == "max_len":
        return MAX_LEN
    if policy == "prompt+max_tokens":
        return req.prompt + MAX_TOKENS
    if policy == "paged16":
        return paged_slots(req.written if written is None else written)
    raise ValueError(f"no policy {policy!r}; one of {', '.join(POLICIES)}")


# --- internal fragmentation -------------------------------------------------------------------


def waste_table(requests: list[Request]) -> list[dict]:
    """Per policy: slots held against slots written, over all requests at their end."""
    written = sum(r.written for r in requests)
    rows = []
    for policy in POLICIES:
        per = [held(policy, r) - r.written for r in requests]
        total = sum(held(policy, r) for r in requests)
        rows.append(
            {
                "policy": policy,
                "requests": len(requests),
                "slots_held": total,
                "slots_written": written,
                "never_written": total - written,
                "written_pct": round(100 * written / total, 1),
                "wasted_pct": round(100 * (total - written) / total, 1),
                "mean_wasted": round(sum(per) / len(per), 1),
                "max_wasted": max(per),
            }
        )
    return rows


def quantile(xs: list[int], q: float) -> int:
    """The nearest-rank quantile: the smallest x with at least q of the values at or below it."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def lengths_table(requests: list[Request], qs=(0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)) -> list[dict]:
    cols = {
        "prompt": [r.prompt for r in requests],
        "output": [r.output for r in requests],
        "written": [r.written for r in requests],
    }
    for policy in POLICIES:
        cols[f"wasted_{policy}"] = [held(policy, r) - r.written for r in requests]
    return [{"quantile": q} | {k: quantile(v, q) for k, v in cols.items()} for q in qs]


# --- external fragmentation: one address range, first fit -------------------------------------


class Arena:
    """Contiguous reservations placed first-fit in slots [0, size).

    `holes` is the free space as sorted (start, length) pairs; a freed range is merged with the
    holes on either side, so two holes never touch (`check_arena`).
    """

    def __init__(self, size: int):
        self.size = size
        self.holes: list[tuple[int, int]] = [(0, size)]

    def alloc(self, n: int) -> int | None:
        """The start of n free slots at the lowest address that has them, or None."""
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                self.holes[i : i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.holes, (start, n))
        lo, hi = start, start + n
        if i < len(self.holes) and self.holes[i][0] == hi:  # the hole just after
            hi += self.holes.pop(i)[1]
        if i > 0 and sum(self.holes[i - 1]) == lo:  # the hole just before
            lo = self.holes.pop(i - 1)[0]
            i -= 1
        self.holes.insert(i, (lo, hi - lo))

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self.holes)

    def stranded(self, need: int = MAX_LEN) -> int:
        """Free slots in holes shorter than `need`: free, yet no use to a reservation of `need`."""
        return sum(length for _, length in self.holes if length < need)


def check_arena(arena: Arena, live: dict[int, tuple[int, int]]) -> None:
    """The holes and the live reservations (rid -> (start, n)) tile [0, size) exactly, in order,
    and no two holes touch (a freed range was merged with its neighbours)."""
    pieces = sorted([(s, n, "hole") for s, n in arena.holes] + [(s, n, rid) for rid, (s, n) in live.items()])
    at, prev = 0, None
    for start, n, what in pieces:
        if start != at:
            raise AssertionError(
                f"{'a gap' if start > at else 'an overlap'} at slot {at} (next piece at {start})"
            )
        if n <= 0:
            raise AssertionError(f"an empty piece at slot {start}")
        if what == "hole" and prev == "hole":
            raise AssertionError(f"two holes touch at slot {start}: a free did not merge them")
        at, prev = start + n, what
    if at != arena.size:
        raise AssertionError(f"the pieces cover {at} slots of {arena.size}")


def simulate(
    requests: list[Request],
    policy: str,
    memory: int = MEMORY,
    arena_cls=Arena,
    check_every: int = 0,
    trace: bool = False,
) -> dict:
    """Run `requests` through one memory of `memory` slots under a contiguous `policy`.

    Each step: arrivals join the queue; requests are admitted first come, first served while
    their reservation fits somewhere (the first that does not fit waits, and so does everyone
    behind it); every running request computes one token (its whole prompt on its first step);
    a request that has produced its `output` tokens leaves and its reservation is freed. A
    request that cannot be placed while nothing runs raises RuntimeError (nothing would ever
    free the room it needs). A `BlockAllocator` with prefix caching off mirrors the running
    requests block by block: each gets its prompt's blocks on admission and one more whenever
    it fills its last.
    `check_every` > 0 runs `check_arena` that often; `trace` keeps every step's sample and the
    arena's layout.
    """
    if policy == "paged16":
        raise ValueError("simulate places contiguous reservations; paged16 is the mirror it keeps")
    arena = arena_cls(memory)
    mirror = BlockAllocator(2 * memory // BLOCK, BLOCK, enable_prefix_caching=False)  # never the limit
    pending, waiting = deque(requests), deque()
    running: dict[int, list] = {}  # rid -> [request, start, size, tokens produced, table, slots written]
    samples, layouts, waits = [], [], []
    blocked_by_holes = 0
    step = 0
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        while waiting:
            req = waiting[0]
            size = held(policy, req)
            start = arena.alloc(size)
            if start is None:
                if not running:  # nothing will ever be freed: the request can never be placed
                    raise RuntimeError(
                        f"step {step}: request {req.rid} needs {size} slots, {arena.free_slots} are free, "
                        f"nothing is running, and the largest hole is {max(n for _, n in arena.holes)}"
                    )
                blocked_by_holes += arena.free_slots >= size  # room enough in all, none in one piece
                break
            waiting.popleft()
            table = BlockTable(BLOCK)
            mirror.allocate_prompt(table, [0] * req.prompt)  # the prefill writes the prompt
            running[req.rid] = [req, start, size, 0, table, req.prompt]
            waits.append(step - req.arrival)
        written = expected = 0
        for entry in running.values():
            req, _, _, produced, table, filled = entry
            if produced:  # a decode step writes the token produced last step
                filled = entry[5] = req.prompt + produced
                if filled > table.capacity:  # into a new block: the only time the allocator is asked
                    mirror.append_slots(table, filled)
            entry[3] = produced + 1
            written += filled
            expected += paged_slots(filled)
        if check_every and step % check_every == 0:
            try:
                check_arena(arena, {rid: (e[1], e[2]) for rid, e in running.items()})
            except AssertionError as e:
                raise AssertionError(f"step {step}: {e}") from None
        paged = mirror.num_used * BLOCK
        assert paged == expected, f"step {step}: the allocator holds {paged} slots, the formula {expected}"
        sample = {
            "step": step,
            "waiting": len(waiting),
            "running": len(running),
            "reserved": memory - arena.free_slots,
            "written": written,
            "paged": paged,
            "free": arena.free_slots,
            "stranded": arena.stranded(MAX_LEN),
            "largest_hole": max((n for _, n in arena.holes), default=0),
        }
        samples.append(sample)
        if trace:
            layouts.append(
                [(e[1], e[2], e[5]) for e in running.values()]  # (start, reserved, written)
            )
        for rid in [rid for rid, e in running.items() if e[3] == e[0].output]:
            req, start, size, _, table, _ = running.pop(rid)
            arena.free(start, size)
            mirror.free(table)
        step += 1
    return {
        "samples": samples,
        "layouts": layouts,
        "waits": waits,
        "blocked_by_holes": blocked_by_holes,
        "memory": memory,
    }


def sim_row(policy: str, result: dict) -> dict:
    """Means over the steps in which a request was waiting: memory is then what holds it back."""
    loaded = [s for s in result["samples"] if s["waiting"]]
    mem = result["memory"]

    def pct(key):
        return round(100 * sum(s[key] for s in loaded) / (len(loaded) * mem), 1)

    return {
        "policy": policy,
        "memory_slots": mem,
        "requests": len(result["waits"]),
        "steps": len(result["samples"]),
        "loaded_steps": len(loaded),
        "mean_running": round(sum(s["running"] for s in loaded) / len(loaded), 1),
        "max_running": max(s["running"] for s in result["samples"]),
        "reserved_pct": pct("reserved"),
        "written_pct": pct("written"),
        "paged_pct": pct("paged"),
        "free_pct": pct("free"),
        "stranded_pct": pct("stranded"),
        "mean_largest_hole": round(sum(s["largest_hole"] for s in loaded) / len(loaded)),
        "blocked_by_holes": result["blocked_by_holes"],
    }


def sim_table(requests: list[Request], memory: int = MEMORY) -> list[dict]:
    return [sim_row(p, simulate(requests, p, memory)) for p in ("max_len", "prompt+max_tokens")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=REQUESTS, help="draws for the waste table")
    p.add_argument("--sim-requests", type=int, default=SIM_REQUESTS, help="arrivals in the simulation")
    p.add_argument("--memory", type=int, default=MEMORY, help="simulated K/V memory, in slots")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out-waste", default=str(CSV_WASTE))
    p.add_argument("--out-lengths", default=str(CSV_LENGTHS))
    p.add_argument("--out-sim", default=str(CSV_SIM))
    args = p.parse_args(argv)
    draws = draw_requests(args.requests, args.seed)
    for name, rows, out in (
        ("waste", waste_table(draws), args.out_waste),
        ("lengths", lengths_table(draws), args.out_lengths),
        ("sim", sim_table(draw_requests(args.sim_requests, args.seed), args.memory), args.out_sim),
    ):
        for r in rows:
            print(name, ", ".join(f"{k}={v}" for k, v in r.items()))
        print(f"wrote {write_csv(rows, out)}")


if __name__ == "__main__":
    main()
