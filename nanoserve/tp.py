"""Tensor parallelism over `torch.distributed`: one model split across processes (day 62).

    torchrun --nproc-per-node 3 -m nanoserve serve      # gloo on CPU, NCCL on CUDA
    torchrun --nproc-per-node 3 -m nanoserve generate "Say hi."
    torchrun --nnodes 3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        --rdzv-id ID -m nanoserve serve                 # the same line on each of 3 machines

Across machines, rank 0 is global RANK 0 as torchrun sets it (the c10d rendezvous assigns the
ranks itself and ignores --node-rank), so whichever machine gets it serves; LOCAL_RANK only
picks the GPU. tests/test_tp.py runs three such launches on 127.0.0.1.

Each block is split Megatron's way, by heads and by MLP columns; every rank holds only its share
of the weights and of the KV pool:

    qkv      rows: rank r's query heads, then its K/V heads (a K/V head travels with the query
             heads that read it, so attention needs nothing from another rank)
    o        columns: the same query heads  -> a partial sum over heads -> all-reduce
    gate_up  rows: columns [r*I/n, (r+1)*I/n) of the MLP, gate and up alike
    down     columns: the same MLP columns  -> a partial sum -> all-reduce
    embed    vocabulary rows [r*V/n, ...): a token is looked up by the rank that holds it, the
             others give zeros -> all-reduce (exact: one term is nonzero)
    head     the same vocabulary rows -> logits for a slice of the vocabulary -> gathered on rank 0
    norms    on every rank

So a step costs 2 all-reduces a block, one for the embedding and one gather of the logits. Only
the o and down all-reduces add floats from different ranks, so the logits differ from one
process's by the order of those sums (fp32 rounding), nothing else.

A K/V head is never split, so the rank count must divide the model's K/V heads (and its MLP
width); `check_split` refuses any other with a sentence naming the counts the model allows.
SmolLM2-135M has 3 K/V heads: 1 or 3 ranks.

Rank 0 owns the engine: the scheduler, the sampling and the server (`/health`, `/metrics`).
Before each step it hands the step's plan to the others (`announce`, `guard`); they
(`run_worker`) wait for plans, run the same forward on their shares and their own pools, and
take part in its collectives. Their pools stay in step with rank 0's because they execute every
plan rank 0 does. The KV pool is planned for the whole model (the same blocks, so the same
schedule, as one process with that budget); each rank holds its heads' part of it. Steps are
eager: buckets, persistent inputs, capture and the fused step are off under tensor parallelism.

The hand-off is two int64 tensors, not a pickle: a header of `HEADER` numbers, the same shape
on every rank (the plan's kind and the length of each of its parts), then one payload holding
the plan's tensors end to end, which the workers split by the header's lengths. Measured with
3 ranks over gloo on the 2-core machine while other jobs loaded it (load average 7-8), decode
plans at a 200-token context in 16-token blocks, 300 hand-offs a figure, two runs; "pickle" is
what `broadcast_object_list` sent before:

    decode rows   pickle                            tensors
     1             3,676 bytes, 3.0-3.6 ms           1,800 bytes, 1.7-1.9 ms
    16            29,358 bytes, 2.9-4.5 ms          27,720 bytes, 1.8-2.1 ms

The bytes barely move at 16 rows (the slot window, B x 208 int64, is most of either); the time
does, and it is the serializing: packing and unpacking in one process took 71 and 85 us against
1.8 and 2.4 ms for torch to pickle and unpickle the same six tensors. Both ways cost two
broadcasts (the pickle's length, then its bytes), and a hand-off counts as one in `collectives`
either way. Only the pool layout at setup still travels as a pickle, once.

Faults: every rank must join within `EngineConfig.join_timeout` (`init`), or the engine's build
fails with a sentence saying so and the server's /health answers 503 "failed". A rank that dies
mid-run closes its sockets; rank 0's next collective raises `RankLost`, which stops the engine
loop: requests in flight end with an error, /health turns 503 "failed" with the reason. Nothing
waits forever on a dead peer. (Under torchrun, a rank that exits non-zero makes its agent stop
the other ranks on that machine, rank 0 included.)

The ranks stay in step only while every collective one of them enters is entered by all, in the
same order. So a step is open on rank 0 from the moment its plan leaves until its logits are
gathered (the step's last collective), and the rule is: an error on rank 0 while a step is open
ends tensor parallelism. `announce` only packs the plan; rank 0's forward sends it as its first
act (`guard`), so an error before that (scheduling, packing, binding the cache) sends nothing:
the ranks are still in step, that step fails alone and serving goes on, as in one process. So
does an error after the gather (sampling, detokenizing). An error while the step is open, on the
other hand, leaves the workers inside a collective rank 0 will never join; the next plan's
broadcast would pair with it. Rank 0 then writes the reason under `BROKEN_KEY` in the group's
store, takes its process groups down and raises `StepBroken` (`fatal`, as `RankLost` is), so the
loop dies as above. The workers stop this way: with gloo, rank 0's sockets close and a worker's
pending collective fails at once; the worker reads the reason from the store, says it in one
line and exits 1. For a collective that may not notice closed sockets (NCCL's, which waits on
the GPU; not tried here, for want of GPUs), each worker runs a thread (`watch_for_break`) that
checks the store every second and, if the main thread has not ended by itself within
BREAK_GRACE, says the same line and ends the process. A rank lost in the middle of a step is
handled the same way, so the ranks still alive stop too.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from nanoserve.errors import NanoserveError
from nanoserve.plan import PrefillPlan, StepPlan

JOIN_TIMEOUT = 60.0  # seconds every rank has to join the group
STEP_TIMEOUT = datetime.timedelta(days=7)  # a collective between steps: an idle server waits long
BROKEN_KEY = "nanoserve/tp/step-broken"  # in the group's store: why rank 0 broke off a step
BREAK_GRACE = 10.0  # seconds a worker's main thread has to end by itself once rank 0 broke a step


class RankLost(RuntimeError):
    """A collective failed: another rank died or dropped its connection. `fatal`: the engine loop
    stops on it (loop.py) instead of failing one step and going on, since no step can run now."""

    fatal = True


class StepBroken(RuntimeError):
    """Rank 0 failed while a step was open (module doc): the workers are inside a collective it
    will never join, so no later step can pair its collectives with theirs. `fatal`, like
    `RankLost`."""

    fatal = True


def launched() -> tuple[int, int] | None:
    """(rank, world size) when this process was started as one of several ranks (torchrun sets
    RANK and WORLD_SIZE; so can anyone), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return int(os.environ.get("RANK", "0")), world


def allowed_ranks(cfg) -> list[int]:
    """Rank counts that split this model: whole K/V heads, whole query heads and an even MLP."""
    return [
        n
        for n in range(1, cfg.num_kv_heads + 1)
        if cfg.num_kv_heads % n == 0 and cfg.num_heads % n == 0 and cfg.intermediate_size % n == 0
    ]


def check_split(cfg, world: int) -> None:
    if world in allowed_ranks(cfg):
        return
    counts = ", ".join(map(str, allowed_ranks(cfg)))
    if cfg.num_kv_heads % world:
        why = (
            f"this model has {cfg.num_kv_heads} K/V heads, and tensor parallelism gives each rank "
            f"whole K/V heads with the query heads that read them"
        )
    else:
        why = f"its MLP is {cfg.intermediate_size} columns wide, which {world} ranks cannot share evenly"
    raise NanoserveError(
        f"{world} ranks cannot split this model: {why}; run it on {counts} rank"
        f"{'s' if counts != '1' else ''} (torchrun --nproc-per-node N)"
    )


@dataclasses.dataclass
class Share:
    """What one rank holds."""

    rank: int
    ranks: int
    heads: int
    kv_heads: int
    mlp_columns: int
    vocab_start: int
    vocab_rows: int  # real rows; the tensor is padded to padded_rows
    padded_rows: int
    weight_bytes: int = 0
    kv_pool_bytes: int = 0
    kv_tokens: int = 0

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.ranks}: {self.heads} query heads, {self.kv_heads} K/V "
            f"head{'s' if self.kv_heads != 1 else ''}, "
            f"{self.mlp_columns} MLP columns, vocabulary rows {self.vocab_start}-"
            f"{self.vocab_start + self.vocab_rows - 1}; weights {self.weight_bytes / 1e6:.1f} MB, "
            f"KV pool {self.kv_pool_bytes / 1e6:.1f} MB ({self.kv_tokens:,} tokens)"
        )


# --- the plan as tensors ------------------------------------------------------------------------

# header: [kind, is_decode, tokens N, rows B, window width W, logits rows M, row spans R,
#          num_decode, decode_width]; kind 0 is "no more steps"
HEADER = 9
STOP, KINDS = 0, (None, StepPlan, PrefillPlan)


def pack_plan(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(header (HEADER,), payload) of int64 for `plan`: its addressing, never its sequences.
    payload = input_ids, positions, write_slots (N each), context_lens (B), slot_window (B*W),
    logits_at (M), row_spans (R*3), end to end."""
    window = plan.slot_window
    spans = torch.tensor(plan.row_spans, dtype=torch.long).reshape(-1)
    header = [
        KINDS.index(type(plan)),
        int(plan.is_decode),
        plan.num_tokens,
        *window.shape,
        plan.logits_at.shape[0],
        len(plan.row_spans),
        getattr(plan, "num_decode", 0),
        getattr(plan, "decode_width", 0),
    ]
    parts = [plan.input_ids, plan.positions, plan.write_slots, plan.context_lens, window, plan.logits_at]
    payload = torch.cat([t.reshape(-1).long().cpu() for t in parts] + [spans])
    return torch.tensor(header, dtype=torch.long), payload


def payload_length(header: list[int]) -> int:
    _, _, n, b, w, m, r, _, _ = header
    return 3 * n + b + b * w + m + 3 * r


def unpack_plan(header: list[int], payload: torch.Tensor):
    """The plan `pack_plan` packed, its tensors views on `payload` (so on payload's device)."""
    kind, is_decode, n, b, w, m, r, num_decode, decode_width = header
    ids, pos, writes, ctx, window, logits_at, spans = torch.split(payload, [n, n, n, b, b * w, m, 3 * r])
    fields = dict(
        input_ids=ids, positions=pos, write_slots=writes, context_lens=ctx, slot_window=window.view(b, w),
        logits_at=logits_at, is_decode=bool(is_decode), row_spans=list(map(tuple, spans.view(r, 3).tolist())),
    )  # fmt: skip
    if KINDS[kind] is PrefillPlan:
        fields |= dict(num_decode=num_decode, decode_width=decode_width)
    return KINDS[kind](**fields)


class TP:
    """A rank's end of the group: the collectives the model calls and the step hand-off."""

    def __init__(self, rank: int, world: int, backend: str, group, share: Share, full_cfg, store=None):
        self.rank, self.world, self.backend, self.group = rank, world, backend, group
        self.share, self.full_cfg = share, full_cfg
        self.store = store  # the group's store; held, so that it outlives the groups (module doc)
        self.device = torch.device("cpu")  # this rank's device (load_share sets it)
        self.collectives = 0  # called by this rank since start (the day counts them)
        self.shares: list[Share] = [share]  # rank 0: every rank's, after `setup`
        self.stopped = False
        self.steps = 0  # plans sent (rank 0) or received (a worker)
        self.pending = None  # rank 0: the packed plan `announce` left for the next forward
        self.open = False  # rank 0: a step's plan has left and its logits are not gathered yet

    def _call(self, fn, *args, counted: bool = True, **kwargs):
        self.collectives += counted
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as e:
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RankLost(f"a tensor-parallel rank is gone: {line[:300]}") from e

    # --- inside the forward ------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._call(dist.all_reduce, x)
        return x

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.share.vocab_start
        mine = (local >= 0) & (local < self.share.vocab_rows)
        x = weight[local.clamp(0, weight.shape[0] - 1)]
        x = torch.where(mine[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        return self.all_reduce(x.contiguous())

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(M, padded_rows) on each rank -> (M, vocab) on rank 0 (other ranks get theirs back)."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world)] if self.rank == 0 else None
        self._call(dist.gather, logits, parts, dst=0)
        if self.rank != 0:
            return logits
        self.open = False  # the step's last collective: the ranks are in step again
        return torch.cat(parts, dim=1)[:, : self.full_cfg.vocab_size]

    # --- the step hand-off ---------------------------------------------------------------------

    def _broadcast(self, obj):
        """A pickle from rank 0: only at setup, once (module doc)."""
        box = [obj]
        self._call(dist.broadcast_object_list, box, src=0)
        return box[0]

    def announce(self, plan) -> None:
        """Rank 0, before each forward: pack the plan every rank runs; `guard`'s forward sends it.
        Nothing leaves here, so an error before the forward leaves the ranks in step."""
        self.pending = pack_plan(plan)

    def guard(self, forward):
        """Rank 0's model forward, wrapped: it sends the announced plan, then runs the step; an
        error while the step is open breaks the group off (`_break_off`, module doc)."""

        def step(*args, **kwargs):
            if self.pending is None:
                raise RuntimeError("rank 0 ran a forward with no plan announced; no other rank would join it")
            (header, payload), self.pending = self.pending, None
            try:
                self.open = True
                self.steps += 1
                self._call(dist.broadcast, header.to(self.device), src=0)
                self._call(dist.broadcast, payload.to(self.device), src=0, counted=False)  # one hand-off
                return forward(*args, **kwargs)
            except BaseException as e:
                if not self.open:  # after the gather: the ranks are in step, the step fails alone
                    raise
                broken = self._break_off(e)
                if broken is None:
                    raise
                raise broken from e

        return step

    def _break_off(self, e: BaseException) -> StepBroken | None:
        """Rank 0 failed inside an open step: leave the reason in the store, take the groups down
        (a gloo worker's pending collective fails at once) and return the fatal error to raise
        (None: raise e itself, a RankLost or an interrupt)."""
        line = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        note = f"rank 0 failed in the middle of step {self.steps} ({type(e).__name__}: {line})"
        self.open, self.stopped = False, True
        try:
            self.store.set(BROKEN_KEY, note)
        except Exception:  # no store, or it is gone: the closed sockets still say it
            pass
        _take_down()
        self.group = None
        if isinstance(e, RankLost) or not isinstance(e, Exception):
            return None
        return StepBroken(
            f"{note}; the other ranks were inside a collective it would not join, so no later step "
            "can run: the group was taken down and the workers exit (restart all ranks)"
        )

    def receive(self):
        """A worker: the next plan, or None when rank 0 has stopped."""
        header = torch.empty(HEADER, dtype=torch.long, device=self.device)
        self._call(dist.broadcast, header, src=0)
        header = header.tolist()
        if header[0] == STOP:
            return None
        payload = torch.empty(payload_length(header), dtype=torch.long, device=self.device)
        self._call(dist.broadcast, payload, src=0, counted=False)  # one hand-off, as on rank 0
        self.steps += 1
        return unpack_plan(header, payload)

    def broken_note(self) -> str | None:
        """A worker: rank 0's reason for breaking off a step, if it left one."""
        try:
            return self.store.get(BROKEN_KEY).decode() if self.store.check([BROKEN_KEY]) else None
        except Exception:  # the store went with rank 0
            return None

    def stop(self) -> None:
        """Rank 0: tell the workers there are no more steps (once; a dead group is let be)."""
        if self.stopped or self.rank != 0:
            return
        self.stopped = True
        try:
            self._call(dist.broadcast, torch.zeros(HEADER, dtype=torch.long, device=self.device), src=0)
            self.leave()
        except RankLost:
            pass

    def leave(self) -> None:
        """Every rank, at the end: meet once more, then take the group down, so that no rank's
        sockets close under another's gloo threads while it is still tearing down."""
        self._call(dist.barrier)
        dist.destroy_process_group()

    def setup(self, engine) -> None:
        """Rank 0, once its engine is built: the pool and linear layout to the workers, every
        rank's share back."""
        self.share.weight_bytes = _weight_bytes(engine.model)
        self.share.kv_tokens = engine.pool.num_slots
        self.share.kv_pool_bytes = pool_bytes(engine.model, engine.pool.num_slots)
        self._broadcast(("setup", engine.pool.num_slots, engine.cache.attention, engine.linear))
        shares = [None] * self.world
        self._call(dist.gather_object, self.share, shares, dst=0)
        self.shares = shares

    def fail_setup(self, reason: str) -> None:
        """Rank 0 could not build its engine: the workers are told instead of left waiting."""
        self.stopped = True
        try:
            self._broadcast(("failed", reason))
        except RankLost:
            pass

    def as_dict(self) -> dict:
        return {
            "ranks": self.world,
            "backend": self.backend,
            "shares": [dataclasses.asdict(s) for s in self.shares],
        }


def _take_down() -> None:
    """Destroy this process's groups (a group already half gone is let be)."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def watch_for_break(store, rank: int, done: threading.Event, poll=1.0, grace=BREAK_GRACE, exit=os._exit):
    """A worker's thread: once rank 0 has left a note under BROKEN_KEY, give the main thread
    `grace` seconds to end by itself (`done`; with gloo its collective fails at once), then say
    the note and end the process, so that a collective that does not notice closed sockets
    cannot keep the rank waiting for STEP_TIMEOUT."""
    while not done.wait(poll):
        try:
            if not store.check([BROKEN_KEY]):
                continue
            note = store.get(BROKEN_KEY).decode()
        except Exception:  # the store went with rank 0: the collectives say so themselves
            return
        if done.wait(grace):
            return
        print(f"nanoserve: error: rank {rank}: {note}; this rank exits", file=sys.stderr, flush=True)
        exit(1)
        return


def _weight_bytes(model) -> int:
    from nanoserve.models import model_weight_bytes

    return model_weight_bytes(model)


def pool_bytes(model, num_slots: int) -> int:
    """Bytes of this rank's K and V pools: its K/V heads for every slot (the sink's included)."""
    cfg = model.cfg
    return 2 * cfg.num_layers * (num_slots + 1) * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize


def init(device: torch.device, join_timeout: float = JOIN_TIMEOUT) -> tuple[int, int, str, object]:
    """Join the group torchrun described (MASTER_ADDR/PORT, RANK, WORLD_SIZE): (rank, world,
    backend, the step group). Raises a NanoserveError if the others do not join in time."""
    rank, world = launched() or (0, 1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=join_timeout))
        group = dist.new_group(backend=backend, timeout=STEP_TIMEOUT)
    except Exception as e:  # the store's timeout, a refused connection: one sentence either way
        line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NanoserveError(
            f"rank {rank} of {world}: the tensor-parallel group did not form within "
            f"{join_timeout:.0f} s ({line[:200]})"
        ) from None
    return rank, world, backend, group


def shard(full, rank: int, world: int):
    """A `Llama` holding rank's share of `full` (module doc); its `tp` is set by `load_share`."""

    cfg = full.cfg
    check_split(cfg, world)
    hd, nh, nkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    vocab = cfg.vocab_size
    nh_l, nkv_l, i_l = nh // world, nkv // world, inter // world
    rows = -(-vocab // world)  # ceil: the last share is padded with zero rows
    local = dataclasses.replace(
        cfg, num_heads=nh_l, num_kv_heads=nkv_l, intermediate_size=i_l, vocab_size=rows
    )
    # the family's own class (a Gemma 3's blocks and rotary tables), on this rank's share
    model = type(full)(local, dtype=full.dtype, device=full.device, max_positions=full.cos.shape[0])
    q = slice(rank * nh_l * hd, (rank + 1) * nh_l * hd)
    k = slice(nh * hd + rank * nkv_l * hd, nh * hd + (rank + 1) * nkv_l * hd)
    v = slice((nh + nkv) * hd + rank * nkv_l * hd, (nh + nkv) * hd + (rank + 1) * nkv_l * hd)
    cols = slice(rank * i_l, (rank + 1) * i_l)
    with torch.no_grad():
        for mine, theirs in zip(model.blocks, full.blocks):
            for attr, _ in mine.NORMS:  # over hidden: whole on every rank
                getattr(mine, attr).copy_(getattr(theirs, attr))
            mine.qkv.copy_(torch.cat([theirs.qkv[q], theirs.qkv[k], theirs.qkv[v]]))
            if mine.qkv_bias is not None:  # split with its rows
                mine.qkv_bias.copy_(torch.cat([theirs.qkv_bias[q], theirs.qkv_bias[k], theirs.qkv_bias[v]]))
            mine.o.copy_(theirs.o[:, q])
            if mine.q_norm is not None:  # over head_dim, the same for every head
                mine.q_norm.copy_(theirs.q_norm)
                mine.k_norm.copy_(theirs.k_norm)
            if mine.o_bias is not None:  # added once to the sum: rank 0 holds it, the others zeros
                mine.o_bias.copy_(theirs.o_bias if rank == 0 else torch.zeros_like(theirs.o_bias))
            mine.gate_up.copy_(torch.cat([theirs.gate_up[cols], theirs.gate_up[inter + rank * i_l :][:i_l]]))
            mine.down.copy_(theirs.down[:, cols])
        model.norm.copy_(full.norm)
        start = rank * rows
        real = max(0, min(vocab, start + rows) - start)
        model.embed.zero_()
        model.embed[:real].copy_(full.embed[start : start + real])
        if not cfg.tie_word_embeddings:
            model.head.zero_()
            model.head[:real].copy_(full.head[start : start + real])
    # the engine checks prompts against the whole vocabulary
    model.cfg = dataclasses.replace(local, vocab_size=vocab)
    share = Share(rank, world, nh_l, nkv_l, i_l, start, real, rows)
    return model.eval(), share


def engine_config(config):
    """The config a tensor-parallel engine runs: eager steps (no buckets, persistent inputs,
    capture or fused step), unquantized weights; quantized weights and speculative decoding are
    refused with a sentence."""
    if config.weights:
        raise NanoserveError(
            f"tensor parallelism splits unquantized matrices; --weights {config.weights} is not split "
            "(run it in one process, or drop --weights)"
        )
    if config.decode_step == "fused":
        raise NanoserveError(
            "the fused decode step runs in one process; under tensor parallelism steps are torch ops"
        )
    if config.speculative:
        raise NanoserveError(
            "speculative decoding is not built for tensor parallelism (a verify step's plan is not "
            "sent to the other ranks); serve it in one process, or drop --speculative"
        )
    return dataclasses.replace(
        config, bucket_decode=False, persist_inputs=False, capture_decode=False, decode_step="ops"
    )


def load_share(config, model_dir, device: torch.device):
    """Join the group, load the model and keep this rank's share: (model, TP). The whole model is
    read once per rank and dropped after the split."""
    from nanoserve.models import LlamaConfig, load_model

    rank, world = launched() or (0, 1)
    check_split(LlamaConfig.from_dir(model_dir), world)  # before anyone waits on anyone
    rank, world, backend, group = init(device, config.join_timeout)
    full = load_model(model_dir, dtype=getattr(torch, config.dtype), device=device)
    model, share = shard(full, rank, world)
    # the default group's store (the rendezvous' TCPStore); torch has no public getter for it
    tp = TP(rank, world, backend, group, share, full.cfg, store=dist.distributed_c10d._get_default_store())
    tp.device = model.device
    del full
    model.tp = tp
    for b in model.blocks:
        b.tp = tp
    if rank == 0:
        model.forward = tp.guard(model.forward)  # sends each plan; breaks the group off on an error
    return model, tp


def run_worker(config) -> None:
    """A rank other than 0: load its share, follow rank 0's plans until it stops."""
    from nanoserve.cache import BatchedPagedKVCache
    from nanoserve.models import pack_linears
    from nanoserve.weights import resolve_model_dir

    config = engine_config(config.validate())
    if config.threads:
        torch.set_num_threads(config.threads)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tp = load_share(config, resolve_model_dir(config.model), device)
    msg = tp._broadcast(None)
    if msg[0] != "setup":
        why = msg[1] if len(msg) > 1 else "rank 0 stopped"
        raise NanoserveError(f"rank {tp.rank}: rank 0's engine did not start ({why})")
    _, num_slots, attention, linear = msg
    if linear == "packed":
        pack_linears(model, rows=config.max_batch)
    cache = BatchedPagedKVCache(model.cfg, num_slots, dtype=model.dtype, device=device, attention=attention)
    tp.share.weight_bytes = _weight_bytes(model)
    tp.share.kv_tokens = num_slots
    tp.share.kv_pool_bytes = pool_bytes(model, num_slots)
    tp._call(dist.gather_object, tp.share, None, dst=0)  # rank 0 prints every rank's share
    done = threading.Event()  # set when this thread is on its way out: the watcher stands down
    threading.Thread(target=watch_for_break, args=(tp.store, tp.rank, done), daemon=True).start()
    steps = 0
    try:
        with torch.inference_mode():
            while (plan := tp.receive()) is not None:
                model(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at)
                steps += 1
    except RankLost as e:
        done.set()
        note = tp.broken_note()
        _take_down()
        if note is not None:
            raise NanoserveError(f"rank {tp.rank}: {note}; this rank exits after {steps} steps") from None
        raise NanoserveError(f"rank {tp.rank}: rank 0 is gone after {steps} steps ({e})") from None
    finally:
        done.set()
    try:
        tp.leave()
    except RankLost:
        pass


def spawn(world: int, args: list[str], port: int | None = None, threads: int = 1, **popen) -> list:
    """`world` processes of `python ARGS...` with the variables torchrun gives its workers
    (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE, OMP_NUM_THREADS), started here: what the
    tests, the benchmark and day 62 use to run ranks they can each watch, wait on and kill
    (torchrun's agent would stop them all when one dies). Returns the Popen objects, rank order."""
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = os.environ | {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": str(threads),
        }
        procs.append(subprocess.Popen([sys.executable, *args], env=env, **popen))
    return procs
