"""Tensor parallelism over `torch.distributed`: one model split across processes (day 62).

    torchrun --nproc-per-node 3 -m nanoserve serve      # gloo on CPU, NCCL on CUDA
    torchrun --nproc-per-node 3 -m nanoserve generate "Say hi."

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
Before each step it broadcasts the step's plan (`announce`); the other ranks (`run_worker`) wait
for plans, run the same forward on their shares and their own pools, and take part in its
collectives. Their pools stay in step with rank 0's because they execute every plan rank 0 does.
The KV pool is planned for the whole model (the same blocks, so the same schedule, as one
process with that budget); each rank holds its heads' part of it. Steps are eager: buckets,
persistent inputs, capture and the fused step are off under tensor parallelism.

Faults: every rank must join within `EngineConfig.join_timeout` (`init`), or the engine's build fails with a
sentence saying so and the server's /health answers 503 "failed". A rank that dies mid-run
closes its sockets; rank 0's next collective raises `RankLost`, which stops the engine loop:
requests in flight end with an error, /health turns 503 "failed" with the reason. Nothing waits
forever on a dead peer. (Under torchrun the agent then stops the remaining ranks too.)
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from nanoserve.errors import NanoserveError

JOIN_TIMEOUT = 60.0  # seconds every rank has to join the group
STEP_TIMEOUT = datetime.timedelta(days=7)  # a collective between steps: an idle server waits long


class RankLost(RuntimeError):
    """A collective failed: another rank died or dropped its connection. `fatal`: the engine loop
    stops on it (loop.py) instead of failing one step and going on, since no step can run now."""

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


class TP:
    """A rank's end of the group: the collectives the model calls and the step hand-off."""

    def __init__(self, rank: int, world: int, backend: str, group, share: Share, full_cfg):
        self.rank, self.world, self.backend, self.group = rank, world, backend, group
        self.share, self.full_cfg = share, full_cfg
        self.device = torch.device("cpu")  # this rank's device (load_share sets it)
        self.collectives = 0  # called by this rank since start (the day counts them)
        self.shares: list[Share] = [share]  # rank 0: every rank's, after `setup`
        self.stopped = False

    def _call(self, fn, *args, **kwargs):
        self.collectives += 1
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
        return torch.cat(parts, dim=1)[:, : self.full_cfg.vocab_size]

    # --- the step hand-off ---------------------------------------------------------------------

    def _broadcast(self, obj):
        box = [obj]
        self._call(dist.broadcast_object_list, box, src=0)
        return box[0]

    def announce(self, plan) -> None:
        """Rank 0, before each forward: the plan every rank runs (addressing only, no sequences)."""
        skip = ("rows", "chunks")  # sequences: rank 0's business
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name not in skip}
        # tensors travel as CPU tensors: each rank puts them on its own device (cuda:r on GPUs)
        fields = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
        self._broadcast(("step", type(plan).__name__, fields))

    def receive(self):
        """A worker: the next plan, or None when rank 0 has stopped (or failed to build)."""
        from nanoserve import plan as plans

        msg = self._broadcast(None)
        if msg[0] != "step":
            return None
        fields = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in msg[2].items()}
        return getattr(plans, msg[1])(**fields)

    def stop(self) -> None:
        """Rank 0: tell the workers there are no more steps (once; a dead group is let be)."""
        if self.stopped or self.rank != 0:
            return
        self.stopped = True
        try:
            self._broadcast(("stop",))
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


def _weight_bytes(model) -> int:
    from nanoserve.model import model_weight_bytes

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
    from nanoserve.model import Llama

    cfg = full.cfg
    check_split(cfg, world)
    hd, nh, nkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    vocab = cfg.vocab_size
    nh_l, nkv_l, i_l = nh // world, nkv // world, inter // world
    rows = -(-vocab // world)  # ceil: the last share is padded with zero rows
    local = dataclasses.replace(
        cfg, num_heads=nh_l, num_kv_heads=nkv_l, intermediate_size=i_l, vocab_size=rows
    )
    model = Llama(local, dtype=full.dtype, device=full.device, max_positions=full.cos.shape[0])
    q = slice(rank * nh_l * hd, (rank + 1) * nh_l * hd)
    k = slice(nh * hd + rank * nkv_l * hd, nh * hd + (rank + 1) * nkv_l * hd)
    v = slice((nh + nkv) * hd + rank * nkv_l * hd, (nh + nkv) * hd + (rank + 1) * nkv_l * hd)
    cols = slice(rank * i_l, (rank + 1) * i_l)
    with torch.no_grad():
        for mine, theirs in zip(model.blocks, full.blocks):
            mine.input_norm.copy_(theirs.input_norm)
            mine.post_norm.copy_(theirs.post_norm)
            mine.qkv.copy_(torch.cat([theirs.qkv[q], theirs.qkv[k], theirs.qkv[v]]))
            mine.o.copy_(theirs.o[:, q])
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
    capture or fused step), unquantized weights; quantized weights are refused with a sentence."""
    if config.weights:
        raise NanoserveError(
            f"tensor parallelism splits unquantized matrices; --weights {config.weights} is not split "
            "(run it in one process, or drop --weights)"
        )
    if config.decode_step == "fused":
        raise NanoserveError(
            "the fused decode step runs in one process; under tensor parallelism steps are torch ops"
        )
    return dataclasses.replace(
        config, bucket_decode=False, persist_inputs=False, capture_decode=False, decode_step="ops"
    )


def load_share(config, model_dir, device: torch.device):
    """Join the group, load the model and keep this rank's share: (model, TP). The whole model is
    read once per rank and dropped after the split."""
    from nanoserve.model import LlamaConfig, load_model

    rank, world = launched() or (0, 1)
    check_split(LlamaConfig.from_dir(model_dir), world)  # before anyone waits on anyone
    rank, world, backend, group = init(device, config.join_timeout)
    full = load_model(model_dir, dtype=getattr(torch, config.dtype), device=device)
    model, share = shard(full, rank, world)
    tp = TP(rank, world, backend, group, share, full.cfg)
    tp.device = model.device
    del full
    model.tp = tp
    for b in model.blocks:
        b.tp = tp
    return model, tp


def run_worker(config) -> None:
    """A rank other than 0: load its share, follow rank 0's plans until it stops."""
    from nanoserve.cache import BatchedPagedKVCache
    from nanoserve.model import pack_linears
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
    steps = 0
    try:
        with torch.inference_mode():
            while (plan := tp.receive()) is not None:
                model(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at)
                steps += 1
    except RankLost as e:
        raise NanoserveError(f"rank {tp.rank}: rank 0 is gone after {steps} steps ({e})") from None
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
