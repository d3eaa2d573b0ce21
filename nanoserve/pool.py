"""How many KV blocks fit in a memory budget (day 16).

`plan_pool` prices one block (K and V, every layer, `block_size` tokens) and divides a budget
by it. On SmolLM2-135M in fp32 (30 layers x 3 KV heads x head dim 64):

    2 x 30 x 3 x 64 x 4 bytes = 46,080 bytes a token;  x 16 tokens = 737,280 bytes a block
    512 MiB budget -> (536,870,912 - 46,080) // 737,280 = 728 blocks = 11,648 tokens

One slot's worth of the budget is set aside for the sink (`sink_slot`), the extra pool entry
that padded rows write to (day 52). `parse_bytes` reads budgets such as "512MiB" from the CLI.

The plan is numbers only: the pools themselves are allocated by `cache.py`, and the blocks are
handed out by `blocks.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

import torch

from nanoserve.models import LlamaConfig

DEFAULT_CPU_BUDGET = 512 * 2**20  # bytes; CPU memory is not queried, so a fixed, modest default

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPES = {name: dt for dt, name in _DTYPE_NAMES.items()} | {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class KVPoolPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "fp32", "bf16", "fp16"
    budget_bytes: int

    @property
    def num_slots(self) -> int:
        """Slots the allocator hands out: 0 .. num_slots - 1."""
        return self.num_blocks * self.block_size

    @property
    def sink_slot(self) -> int:
        """The index right after the real slots (= num_slots); each pool has num_slots + 1 entries."""
        return self.num_slots

    @property
    def max_tokens(self) -> int:
        """Tokens all sequences together can hold at once."""
        return self.num_slots

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def total_bytes(self) -> int:
        """Bytes of the blocks alone."""
        return self.num_blocks * self.bytes_per_block

    @property
    def pool_bytes(self) -> int:
        """Bytes the K and V pools take, sink slot included."""
        return self.total_bytes + self.bytes_per_slot

    def describe(self) -> str:
        return (
            f"KV pool: {self.num_blocks:,} blocks x {self.block_size} tokens = {self.num_slots:,} tokens, "
            f"{self.pool_bytes / 1e6:,.1f} MB (budget {self.budget_bytes / 1e6:,.1f} MB, {self.dtype}, "
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim})"
        )


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPE_NAMES:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"the KV cache dtype must be one of fp32, bf16, fp16; got {dtype!r}")


def plan_pool(
    cfg: LlamaConfig,
    dtype: torch.dtype | str,
    block_size: int = 16,
    budget_bytes: int | str | None = None,
    device: str | torch.device = "cpu",
    gpu_fraction: float = 0.9,
    min_blocks: int = 1,
) -> KVPoolPlan:
    """The most blocks of `block_size` tokens (plus the sink slot) that fit the budget.

    budget_bytes None means: on CUDA, gpu_fraction of the memory free right now (so call this
    after the weights are loaded); on CPU, DEFAULT_CPU_BUDGET.
    """
    dtype = _as_dtype(dtype)
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1 token, got {block_size}")
    bytes_per_slot = cfg.kv_bytes_per_token(dtype)
    bytes_per_block = bytes_per_slot * block_size
    if isinstance(budget_bytes, str):
        budget_bytes = parse_bytes(budget_bytes)
    if budget_bytes is None:
        device = torch.device(device)
        if device.type == "cuda":
            if not 0 < gpu_fraction <= 1:
                raise ValueError(f"gpu_fraction must be in (0, 1], got {gpu_fraction}")
            free, _total = torch.cuda.mem_get_info(device)
            budget_bytes = int(free * gpu_fraction)
        else:
            budget_bytes = DEFAULT_CPU_BUDGET
    num_blocks = max(0, (budget_bytes - bytes_per_slot) // bytes_per_block)
    if num_blocks < min_blocks:
        need = min_blocks * bytes_per_block + bytes_per_slot
        raise ValueError(
            f"a KV budget of {budget_bytes:,} bytes holds {num_blocks} blocks, fewer than the "
            f"{min_blocks} needed: one block of {block_size} tokens needs {bytes_per_block:,} bytes "
            f"in {dtype_name(dtype)}, so give at least {need:,} bytes (sink slot included)"
        )
    return KVPoolPlan(
        num_blocks=num_blocks,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=dtype_name(dtype),
        budget_bytes=budget_bytes,
    )


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bf16"."""
    return _DTYPE_NAMES[dtype]


# --- sizes on the command line ---------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: int | str) -> int:
    """A size in bytes: 123 -> 123, "1e9" -> 1000000000, "2GB" -> 2000000000, "512MiB" -> 536870912.

    Units (any case): B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024).
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"a size must be a number of bytes or a string like '512MiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with an optional unit, e.g. 536870912, "
            "1e9, 512MiB or 2GB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    size = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    if size >= 2**64:  # also keeps "1e999999" from building a huge int
        raise ValueError(f"{text!r} is more bytes than any machine has; check the exponent and unit")
    if size != size.to_integral_value():
        raise ValueError(f"{text!r} is {size} bytes; a size must come to a whole number of bytes")
    return int(size)
