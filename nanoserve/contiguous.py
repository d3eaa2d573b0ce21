"""A contiguous K/V cache for one sequence (day 11), and the cacheless baseline (day 8).

`ContiguousKVCache` reserves `max_len` positions per layer up front and fills them in order:
prefill writes the prompt's K/V in one go, each decode step appends one token's. Attention
reads the filled prefix. This is the simplest cache that turns generation from quadratic into
linear work per token, and the one Day 13 measures the waste of (every sequence pays for
`max_len` positions, used or not).

`NoCache` keeps nothing: attention sees only the tokens of the current call, so generating with
it means re-running the whole sequence every step (Day 8's quadratic loop).

The paged, batched cache lives in `cache.py`; both speak the protocol in `model.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.models import LlamaConfig


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    window: int | None = None,
    scale: float | None = None,
):
    """Attention of q (N, nh, hd) over keys 0..L-1 (k, v: (nkv, L, hd)), query i seeing keys <=
    q_positions[i], and with a `window` only the latest `window` of them (a sliding layer:
    keys j with q_positions[i] - j < window). Grouped-query: each K/V head serves nh/nkv query
    heads. `scale` multiplies q.k (None: head_dim ** -0.5)."""
    n, nh, hd = q.shape
    length = k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, nh, N, hd)
    kh, vh = k.unsqueeze(0), v.unsqueeze(0)  # (1, nkv, L, hd)
    if n == 1 and (window is None or length <= window):
        mask = None  # one query at the end of the sequence sees every key
    else:
        keys = torch.arange(length, device=q.device)[None, :]
        mask = keys <= q_positions[:, None]  # (N, L)
        if window is not None:
            mask &= keys > q_positions[:, None] - window
    out = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, enable_gqa=nh != kh.shape[1], scale=scale
    )
    return out[0].transpose(0, 1)  # (N, nh, hd)


class ContiguousKVCache:
    """K/V for one sequence in preallocated (kv_heads, max_len, head_dim) tensors per layer."""

    def __init__(self, cfg: LlamaConfig, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.max_len = max_len
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]  # None: the whole context
        self.scale = cfg.query_scale  # None: SDPA's own head_dim ** -0.5
        self.length = 0  # positions filled, including the step being run
        self.start = 0  # first position of the step being run

    def begin(self, positions: torch.Tensor) -> None:
        """Announce a step over `positions` (consecutive, starting at the current length)."""
        n = positions.shape[0]
        if self.length + n > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; this step needs {self.length + n}")
        self.positions = positions
        self.start, self.length = self.length, self.length + n

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][:, self.start : self.length] = k.transpose(0, 1)  # (nkv, N, hd)
        self.v[layer][:, self.start : self.length] = v.transpose(0, 1)

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        k = self.k[layer][:, : self.length]
        v = self.v[layer][:, : self.length]
        return causal_attention(q, k, v, self.positions, self.windows[layer], self.scale)


class NoCache:
    """Attention over the current call's tokens only: the cacheless baseline."""

    def begin(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k.transpose(0, 1), v.transpose(0, 1)  # (nkv, N, hd)

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, self.k, self.v, self.positions)
