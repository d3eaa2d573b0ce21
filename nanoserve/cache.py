"""The paged K/V cache shared by every sequence of a batch (days 17-18 and 24).

`BatchedPagedKVCache` holds, per layer, one K pool and one V pool of shape
(num_slots + 1, kv_heads, head_dim). A slot is one token's K/V; slot `s` lives in block
`s // block_size`, and which blocks a sequence owns is the allocator's business (`blocks.py`).
The extra entry at index `sink_slot` (= num_slots) is the sink: it exists in every pool but
belongs to no block, so it is where padded rows of a bucketed batch (day 52) write the K/V
nobody will read.

A step's addressing comes from a `StepPlan` (`plan.py`); `view(plan)` binds the two into a
`BatchedCacheRows`, which is the object the model talks to (`write`, `attention`):

* `write` is one `index_put_` of the step's N new K/V rows at `plan.write_slots`.
* `attention` gathers each row's keys through its slot window `plan.slot_window[r, :W]` and
  masks every position at or past `plan.context_lens[r]` (a prompt row's causal mask is built
  once a step and shared by the layers). With `attention="native"` one-query rows skip the copy
  and the mask: the C++ kernel reads each row's K/V where it lies (phase 6, `kernels.py`), its
  window checked once a step and each layer's pools against it.
  A decode step is one batched gather and one SDPA over (rows, W); a prefill step runs each
  row's queries (a ragged chunk of its prompt, packed with the others) against its own window,
  causally; a mixed step's decode rows come first and are batched as in decode. A row with
  context_lens 0 is fully masked and yields zeros, never NaN.

A layer's pools are allocated on its first write (`_ensure_pool`), so building a cache is free,
unless something asks for every layer's at once (`ensure_pools`): a warmed boot does, in
`Engine.warm_trim` and `warm_decode`, before it measures free memory and records (day 56), and
the fused decode step does on each call, so its native code finds every pool there. A lazy boot
on the ops path therefore takes the memory during its first request's prefill, layer by layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.models import LlamaConfig

ATTENTION = ("auto", "native", "gather")


class BatchedPagedKVCache:
    """`attention` picks how one-query rows (decode) read the pools: "gather" copies each row's
    window (padded to the widest) and runs SDPA on the copy, the way days 18-24 build it;
    "native" reads them in place with the C++ kernel (`kernels.py`); "auto" takes native on a
    CPU where it builds, else gather."""

    def __init__(
        self, cfg: LlamaConfig, num_slots: int, dtype=torch.float32, device="cpu", attention: str = "auto"
    ):
        if attention not in ATTENTION:
            raise ValueError(f"attention is one of {', '.join(ATTENTION)}, not {attention!r}")
        self.cfg, self.num_slots, self.dtype, self.device = cfg, num_slots, dtype, torch.device(device)
        self.attention = self._resolve(attention)
        self.sink_slot = num_slots
        # a sliding layer's window (it reads its latest `window` positions only), None: all
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]
        self.scale = cfg.query_scale  # None: head_dim ** -0.5, SDPA's own
        # the sliding layers' own blocks (`set_window_blocks`): None while they share the slots
        self.local_of: torch.Tensor | None = None
        self.block_size = self.local_slots = 0
        self.k: list[torch.Tensor | None] = [None] * cfg.num_layers
        self.v: list[torch.Tensor | None] = [None] * cfg.num_layers
        self._step_memo: dict | None = None  # the step's memo while a step's layer calls attention

    def _resolve(self, attention: str) -> str:
        if attention == "native" and self.device.type != "cpu":
            raise ValueError(
                f"the native attention kernel is for CPU; on {self.device.type} use auto or gather"
            )
        if attention == "gather" or self.device.type != "cpu":
            return "gather"
        from nanoserve.kernels import native, native_status

        if native() is None:
            if attention == "native":
                raise ValueError(f"the native attention kernel is {native_status()}")
            return "gather"
        return "native"

    def set_window_blocks(self, local_of: torch.Tensor, num_blocks: int, block_size: int) -> None:
        """Give the sliding layers pools of their own: `num_blocks` blocks and a hole block
        after them, found through `local_of` (full block -> sliding block, `blocks.WindowBlocks`)."""
        if any(t is not None for t in self.k):
            raise ValueError("the pools are allocated already; set the sliding layers' blocks first")
        self.local_of, self.block_size = local_of.to(self.device), block_size
        self.local_slots = (num_blocks + 1) * block_size

    def _to_local(self, slots: torch.Tensor) -> torch.Tensor:
        """Full slots -> the sliding layers' slots: the same offset in the block `local_of` maps
        the full block to (a block no row holds maps to the hole, read by no query)."""
        bs = self.block_size
        return self.local_of[torch.div(slots, bs, rounding_mode="floor")] * bs + slots % bs

    def _ensure_pool(self, layer: int) -> None:
        if self.k[layer] is None:
            grouped = self.local_of is not None and self.windows[layer] is not None
            rows = self.local_slots if grouped else self.num_slots + 1
            shape = (rows, self.cfg.num_kv_heads, self.cfg.head_dim)
            self.k[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v[layer] = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def ensure_pools(self) -> None:
        """Allocate every layer's pools now (a warm-up wants them resident before the door opens)."""
        for layer in range(self.cfg.num_layers):
            self._ensure_pool(layer)

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan, memo: dict | None = None) -> None:
        """Store the step's new K/V, (N, kv_heads, head_dim) each, at plan.write_slots (N,)
        (for a sliding layer with its own blocks: where they map to, once a step)."""
        self._ensure_pool(layer)
        slots = plan.write_slots
        if self.local_of is not None and self.windows[layer] is not None:  # (inline: days 48-49 count calls)
            memo = {} if memo is None else memo
            slots = memo.get("local writes")
            if slots is None:
                slots = memo["local writes"] = self._to_local(plan.write_slots)
        self.k[layer].index_put_((slots,), k)
        self.v[layer].index_put_((slots,), v)

    def paged_attention(self, layer: int, q: torch.Tensor, plan, memo: dict | None = None) -> torch.Tensor:
        """q (N, heads, head_dim) -> (N, heads, head_dim), each row reading only its own slots.
        `memo` keeps what every layer of one step shares (a prompt row's causal mask), so it is
        built once a step; native decode rows need no mask at all."""
        # gather is the earlier way exactly (days 18-56 count its ops): a mask per row per layer
        memo = {} if memo is None or self.attention == "gather" else memo
        if plan.is_decode:
            return self._decode_attention(layer, q, plan, memo)
        return self._prefill_attention(layer, q, plan, memo)

    def _decode_attention(self, layer: int, q: torch.Tensor, plan, memo: dict) -> torch.Tensor:
        self._step_memo = memo
        try:
            return self._one_query_rows(layer, q, plan.slot_window, plan.context_lens)
        finally:
            self._step_memo = None

    def _one_query_rows(self, layer: int, q: torch.Tensor, window: torch.Tensor, context_lens):
        """Rows of one query each (decode): q (B, nh, hd) against window (B, W), context_lens (B,).
        Called by a step (`_step_memo` is then the step's memo, shared by its layers, and set
        only for the call), the native kernel's window is checked and copied once (a
        `DecodeWindow`), and each layer's call checks only its own pools against it, O(1),
        instead of every slot of the window once a layer; called alone it checks its window. The
        signature stays the four arguments the course's days call and override.

        A sliding layer reads its rows' latest `window` positions: their slots are cut out of the
        window first (`_latest`), once a step, so both paths below see a narrower window."""
        memo = self._step_memo if self._step_memo is not None else {}
        keep = self.windows[layer]
        local = keep is not None and (window.shape[1] > keep or self.local_of is not None)
        if local:
            latest = memo.get(("latest", keep))
            if latest is None:
                if window.shape[1] > keep:
                    window, context_lens = _latest(window, context_lens, keep)
                if self.local_of is not None:
                    window = self._to_local(window)
                latest = memo[("latest", keep)] = (window, context_lens)
            window, context_lens = latest
        if self.attention == "native":  # in place: no copy, no mask
            from nanoserve.kernels import native

            ext = native()
            key = ("native latest", keep) if local else "native window"
            checked = memo.get(key)
            if checked is None:
                checked = memo[key] = ext.DecodeWindow(window, context_lens)
            scale = self.cfg.attention_scale
            return ext.decode_attention_checked(q, self.k[layer], self.v[layer], checked, scale)
        # gather (days 18-56, kept as it was): each row's window copied, padding and all, then SDPA
        rows, width = window.shape
        flat = window.reshape(-1)  # (B*W,) slot numbers
        # index_select, not pool[window]: the same gather, ~4x faster on CPU (one memcpy per slot)
        k = self.k[layer].index_select(0, flat).view(rows, width, *self.k[layer].shape[1:])  # (B, W, kv, hd)
        v = self.v[layer].index_select(0, flat).view(rows, width, *self.v[layer].shape[1:])
        visible = torch.arange(width, device=q.device)[None, :] < context_lens[:, None]  # (B, W)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, nh, 1, hd)
            k.transpose(1, 2),  # (B, kv, W, hd)
            v.transpose(1, 2),
            attn_mask=visible[:, None, None, :],  # (B, 1, 1, W)
            enable_gqa=q.shape[1] != k.shape[2],
            scale=self.scale,
        )[:, :, 0]  # (B, nh, hd)
        # A fully masked row (context_lens 0: a padded row) comes out of softmax as NaN.
        return torch.where((context_lens > 0)[:, None, None], out, 0.0)

    def _prefill_attention(self, layer: int, q: torch.Tensor, plan, memo: dict) -> torch.Tensor:
        out = torch.zeros_like(q)
        d = plan.num_decode  # a mixed step's decode rows: one query each, batched as in decode
        if d:  # their windows cut to the widest of them, not to the widest prompt of the step
            nq = plan.row_spans[d - 1][1]  # their queries: d, or more where a row carries a draft
            if nq == d:
                window, context_lens = plan.slot_window[:d, : plan.decode_width], plan.context_lens[:d]
            else:  # speculative decoding: a row's k+1 queries as k+1 one-query rows on its window
                window, context_lens = self._draft_rows(plan, d, memo)
            self._step_memo = memo  # one decode window a step, whichever layer slices it
            try:
                out[:nq] = self._one_query_rows(layer, q[:nq], window, context_lens)
            finally:
                self._step_memo = None
        window = self.windows[layer]
        for r, (start, end, ctx) in enumerate(plan.row_spans):
            if r < d or end == start or ctx == 0:
                continue
            n = end - start
            if window is not None and (ctx > window or self.local_of is not None):  # a sliding layer
                out[start:end] = self._windowed_chunk(
                    layer, q[start:end], plan.slot_window[r], ctx, window, memo, r
                )
                continue
            slots = plan.slot_window[r, :ctx]  # (ctx,) this row's keys, oldest first
            k = self.k[layer].index_select(0, slots).transpose(0, 1)[None]  # (1, kv, ctx, hd)
            v = self.v[layer].index_select(0, slots).transpose(0, 1)[None]
            qr = q[start:end].transpose(0, 1)[None]  # (1, nh, n, hd)
            # query i sits at position ctx - n + i and sees keys up to and including itself
            gqa = qr.shape[1] != k.shape[1]
            if self.attention == "native":  # (gather keeps the ops days 18-56 count)
                # contiguous operands: SDPA's CPU flash kernel on the strided views took ~10 ms a
                # layer for a 512-token prompt of 14 query heads over 2 K/V heads, on copies ~7.4;
                # a whole prompt (no cached context) needs no mask: plain causal
                qr, k, v = qr.contiguous(), k.contiguous(), v.contiguous()
                if n == ctx:
                    o = F.scaled_dot_product_attention(
                        qr, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale
                    )
                    out[start:end] = o[0].transpose(0, 1)
                    continue
            mask = memo.get(r)
            if mask is None:
                mask = memo[r] = (
                    torch.arange(ctx, device=q.device)[None, :]
                    <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
                )
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _draft_rows(plan, d: int, memo: dict):
        """The leading d rows' queries as one-query rows: query j of a row whose chunk ends at
        context ctx with n tokens sees ctx - n + j + 1 positions of the row's window (a
        speculative row's newest token and its draft). Once a step, shared by every layer."""
        got = memo.get("draft rows")
        if got is None:
            rows, lens = [], []
            for r, (start, end, ctx) in enumerate(plan.row_spans[:d]):
                rows += [r] * (end - start)
                lens += range(ctx - (end - start) + 1, ctx + 1)
            device = plan.slot_window.device
            index = torch.tensor(rows, dtype=torch.long, device=device)
            window = plan.slot_window[:d, : plan.decode_width].index_select(0, index)
            got = memo["draft rows"] = (window, torch.tensor(lens, dtype=torch.long, device=device))
        return got

    def _windowed_chunk(self, layer, q, row_window, ctx: int, window: int, memo: dict, r: int):
        """A prompt chunk's queries (n, nh, hd) at positions ctx - n .. ctx - 1 on a sliding
        layer: query p sees keys j with p - window < j <= p, so only keys from
        ctx - n - window + 1 on are read (a band, not the whole context)."""
        n = q.shape[0]
        lo = max(0, ctx - n - window + 1)
        slots = row_window[lo:ctx] if self.local_of is None else self._to_local(row_window[lo:ctx])
        k = self.k[layer].index_select(0, slots).transpose(0, 1)[None].contiguous()  # (1, kv, ctx-lo, hd)
        v = self.v[layer].index_select(0, slots).transpose(0, 1)[None].contiguous()
        mask = memo.get((r, "band"))
        if mask is None:
            keys = torch.arange(lo, ctx, device=q.device)[None, :]
            pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            mask = memo[(r, "band")] = (keys <= pos) & (keys > pos - window)
        qr = q.transpose(0, 1)[None].contiguous()  # (1, nh, n, hd)
        o = F.scaled_dot_product_attention(
            qr, k, v, attn_mask=mask, enable_gqa=qr.shape[1] != k.shape[1], scale=self.scale
        )
        return o[0].transpose(0, 1)

    def view(self, plan) -> BatchedCacheRows:
        """Bind a plan. `write` and `paged_attention` read the rows a plan addresses, which for a
        warm plan (day 55) is none, all padding; a plan of zero tokens is refused, since there
        would be no step to run."""
        if plan.num_tokens == 0:
            raise ValueError("a step over no tokens at all has nothing to compute; schedule something first")
        return BatchedCacheRows(self, plan)


def _latest(window: torch.Tensor, context_lens: torch.Tensor, keep: int):
    """Rows' slots of their latest `keep` positions, oldest first: (B, keep) cut from
    window (B, W) at each row's context_len - keep (0 for a row shorter than that), and the
    counts that are real, min(context_len, keep). What a sliding layer's one-query rows read."""
    start = (context_lens - keep).clamp(min=0)  # (B,)
    cols = (start[:, None] + torch.arange(keep, device=window.device)).clamp(max=window.shape[1] - 1)
    return window.gather(1, cols), context_lens.clamp(max=keep)


class BatchedCacheRows:
    """A cache bound to one step's plan: what `Llama.forward` writes to and reads from."""

    def __init__(self, cache: BatchedPagedKVCache, plan):
        self.cache, self.plan = cache, plan
        self.memo: dict = {}  # what every layer of this step shares: masks, the checked native window

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.cache.local_of is None:  # the four arguments days 17-56 override `write` with
            self.cache.write(layer, k, v, self.plan)
        else:  # the sliding layers' slots, mapped once a step
            self.cache.write(layer, k, v, self.plan, self.memo)

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.cache.paged_attention(layer, q, self.plan, self.memo)
